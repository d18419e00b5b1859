"""Per-device precision, the running part: Lightning's precision plugin for a rank with its own precision.

The strategy installs :class:`HeteroPrecision` in place of the Trainer's precision plugin when
``HeteroStrategy(device_precision=...)`` is given. Every rank runs DeepSpeed in fp32 (what the collectives see),
and this plugin adds three things at Lightning's precision hooks:

* the rank's ``torch.autocast`` around each step, applied inside DeepSpeed's engine (:class:`AutocastInside`):
  the engine resets CUDA autocast when it is entered, so an autocast around the engine would not reach the model;
* on fp16 ranks, the job's loss scale on the loss before backward, and its removal from each gradient as autograd
  produces it, before DeepSpeed reduces it (:class:`UnscaledGradients`), which also notes any inf/NaN;
* before DeepSpeed's optimizer step, one all-gather of every rank's overflow flag (only in jobs with an fp16 rank):
  an overflow anywhere makes every rank skip the step and lower the scale (:func:`skip_agreed_overflows`).

The loss scale's state is the plugin's ``state_dict``, which Lightning saves into every checkpoint and restores.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from torch import Tensor
from typing_extensions import override

from lightning_hetero.precision.choice import (
    BF16,
    FP16,
    FP32,
    DynamicLossScale,
    needs_loss_scale,
    reduces_in_parameter_order,
)

_AUTOCAST_DTYPES = {BF16: torch.bfloat16, FP16: torch.float16}


def autocast_for(precision: str, device_type: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the autocast context of ``precision`` on ``device_type`` (a null context for fp32)."""
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


class AutocastInside:
    """Lightning's forward redirection with the step method run under this rank's autocast.

    Lightning calls ``training_step`` (and the evaluation steps) through the DeepSpeed engine's ``forward``, which
    resets CUDA autocast on entry unless DeepSpeed's own (job-wide) autocast is on. The autocast is therefore
    entered inside: for the duration of one redirected call, the module's step method is shadowed by one that runs
    under it. Backward then follows the dtypes autograd recorded, as with Lightning's own mixed precision.
    """

    def __init__(self, redirection: _ForwardRedirection, autocast: Callable[[], contextlib.AbstractContextManager]):
        self.redirection = redirection
        self.autocast = autocast

    def __call__(self, wrapper_module: Any, original_module: Any, method_name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(original_module, method_name)
        shadowed = original_module.__dict__.get(method_name)
        autocast = self.autocast

        def under_autocast(*inner_args: Any, **inner_kwargs: Any) -> Any:
            with autocast():
                return method(*inner_args, **inner_kwargs)

        original_module.__dict__[method_name] = under_autocast
        try:
            return self.redirection(wrapper_module, original_module, method_name, *args, **kwargs)
        finally:
            if shadowed is None:
                del original_module.__dict__[method_name]
            else:
                original_module.__dict__[method_name] = shadowed


class UnscaledGradients:
    """Divides each parameter's gradient by the loss scale as autograd produces it, and notes any inf/NaN.

    Tensor hooks on the parameters run before the gradient is accumulated, so before DeepSpeed's own hooks see it
    (ZeRO-2/3 reduce buckets during backward): what travels between ranks is always the unscaled gradient, the same
    quantity an fp32 or bf16 rank contributes.
    """

    def __init__(
        self, parameters: Iterable[torch.nn.Parameter], device: torch.device, loss_scale: DynamicLossScale
    ) -> None:
        self.loss_scale = loss_scale  # read at every gradient: the scale of the backward that produced it
        self.found_inf = torch.zeros((), device=device)
        self._handles = [p.register_hook(self._unscale) for p in parameters if p.requires_grad]

    def _unscale(self, grad: Tensor) -> Tensor:
        unscaled = grad * (1.0 / self.loss_scale.scale)  # a new tensor: a hook must not change the one it is passed
        self.found_inf += torch.isfinite(unscaled).all().logical_not()
        return unscaled

    def track(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Also unscale these parameters' gradients (parameters that joined the module after the engine was built)."""
        self._handles += [p.register_hook(self._unscale) for p in parameters if p.requires_grad]

    def take_found_inf(self) -> Tensor:
        """How many gradients were not finite since the last call (a device tensor), and reset the count."""
        found = self.found_inf.clone()
        self.found_inf.zero_()
        return found

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def skip_agreed_overflows(optimizer: Any, should_skip: Callable[[], bool]) -> Callable[[], None]:
    """Make DeepSpeed's optimizer step skip when ``should_skip()`` (the agreed decision), as for its own fp16 overflows.

    DeepSpeed already knows how to skip a step cleanly, per stage, for its fp16 mode: it checks an ``overflow`` flag,
    releases its reduced-gradient buffers, and counts ``engine.skipped_steps``. In fp32 that check is off (ZeRO-1/2)
    or not made (ZeRO-3); here the agreed decision becomes the check. ZeRO-0 steps the plain torch optimizer, which is
    skipped directly (the engine zeroes the gradients after it either way). Returns a function that undoes this.
    """
    if hasattr(optimizer, "_overflow_check_and_loss_scale_update"):  # ZeRO-3
        original = optimizer._overflow_check_and_loss_scale_update

        def check_zero3(update_scale: bool = True) -> bool:
            overflow = bool(original(update_scale=False)) or should_skip()
            optimizer.overflow = overflow
            return optimizer._loss_scale_update_and_overflow_cleanup() if update_scale else overflow

        optimizer._overflow_check_and_loss_scale_update = check_zero3
        return lambda: optimizer.__dict__.pop("_overflow_check_and_loss_scale_update", None)
    if hasattr(optimizer, "check_overflow") and hasattr(optimizer, "check_grad_overflow"):  # ZeRO-1/2
        checked = optimizer.check_grad_overflow

        def check_zero12(partition_gradients: bool = True) -> None:
            optimizer.overflow = should_skip()

        optimizer.check_overflow = check_zero12
        optimizer.check_grad_overflow = True

        def undo_zero12() -> None:
            optimizer.__dict__.pop("check_overflow", None)
            optimizer.check_grad_overflow = checked

        return undo_zero12
    if isinstance(optimizer, torch.optim.Optimizer):  # ZeRO-0: DeepSpeed steps the user's optimizer itself
        step = optimizer.step
        earlier = optimizer.__dict__.get("step")  # (an LR scheduler's counting wrapper, set on the instance)
        patched: Any = optimizer  # (given instance attributes: `overflow`, and a `step` that shadows the method)

        # functools.wraps carries the scheduler's mark (`_wrapped_by_lr_sched`) over: without it torch's scheduler
        # warned at its first step that `optimizer.step()` "has been overridden after learning rate scheduler
        # initialization", on every rank of every fit with a scheduler.
        @functools.wraps(step)
        def skippable_step(*args: Any, **kwargs: Any) -> Any:
            patched.overflow = should_skip()  # the engine reads it to count skipped steps
            return None if patched.overflow else step(*args, **kwargs)

        patched.step = skippable_step

        def undo_zero0() -> None:
            optimizer.__dict__.pop("step", None)
            if earlier is not None:  # (the scheduler's wrapper stays: it counts the next fit's steps)
                optimizer.__dict__["step"] = earlier
            optimizer.__dict__.pop("overflow", None)

        return undo_zero0
    raise TypeError(
        f"HeteroStrategy(device_precision=...) with fp16 ranks cannot skip the steps of DeepSpeed's"
        f" {type(optimizer).__name__}: use ZeRO stage 0-3 without DeepSpeed's own fp16/bf16 modes, or give no rank"
        " '16-mixed'."
    )


class ParameterOrderReduction:
    """ZeRO-2/3 reduce gradients in the order autograd produces them; make them reduce in parameter order instead.

    ZeRO-2/3 copy each gradient into a bucket as it arrives during backward and reduce the bucket across ranks by
    position, which assumes every rank produces its gradients in the same order. Ranks under different autocasts do
    not: the casts change the graph and autograd visits the parameters in another order (measured: a bf16 rank
    produced `W2, b2, W1, b1` while an fp32 rank produced `b2, W2, b1, W1`), and the reduction then adds unrelated
    gradients together, silently (first-step parameters off by 0.1 in the test model). DeepSpeed's
    ``coalesce_grad_reduction`` has the cure: with its flag set the hooks leave each gradient on its parameter during
    the optimizer step's backward passes, and its flush reduces them all in parameter order before the step.

    The flag and the flush are driven directly rather than through the engine's context manager: that context
    flushes (collectives) whenever it is left, also when a failure on one rank abandons the step, which would send
    that rank into reductions its peers never join. Here leaving without the flush is :meth:`undo`.

    * ZeRO-3 (DeepSpeed's managed accumulation, see
      :func:`~lightning_hetero.configure.deepspeed_config.lightning_owns_accumulation`): what the engine's context does
      on entry (no boundary work in backward) and on a normal exit (the flush).
    * ZeRO-2 (unmanaged accumulation): the flag, and the end-of-backward epilogue held back until the flush runs it.
    * ZeRO-0/1 reduce in parameter order at the step already: not used there.

    The cost: until the step every rank holds the full gradient of every parameter (ZeRO-2/3 otherwise keep only
    their partition), and reduction no longer overlaps backward.
    """

    def __init__(self, engine: Any) -> None:
        missing = [name for name in _COALESCE_API if not hasattr(engine, name)]
        if missing or not hasattr(engine.optimizer, "_coalesce_grad_reduction"):
            raise RuntimeError(
                "HeteroStrategy(device_precision=...) with ranks in different precisions needs DeepSpeed's"
                f" coalesce_grad_reduction (0.19.8 has it; this DeepSpeed lacks {missing or ['its optimizer flag']})."
                " Upgrade DeepSpeed, or use ZeRO stage 0 or 1, or give every rank the same precision."
            )
        self.engine = engine
        self.optimizer = engine.optimizer
        self.stage = engine.zero_optimization_stage()
        self._open = False  # ZeRO-3: a step's backward passes are under way, their gradients not yet reduced
        self._saved_boundary: Optional[bool] = None  # ... and the engine's boundary flag (None until its first step)
        if self.stage == 2:
            optimizer = self.optimizer
            epilogue = optimizer.overlapping_partition_gradients_reduce_epilogue

            def epilogue_at_flush_only() -> None:
                if not optimizer._coalesce_grad_reduction:
                    epilogue()

            optimizer.overlapping_partition_gradients_reduce_epilogue = epilogue_at_flush_only
            optimizer._coalesce_grad_reduction = True

    def before_backward(self) -> None:
        if self.stage == 3 and not self._open:
            self._open = True
            self._saved_boundary = self.engine._is_gradient_accumulation_boundary
            self.engine.inside_no_sync_ctxt = True
            self.optimizer._coalesce_grad_reduction = True

    def before_step(self) -> None:
        engine, optimizer = self.engine, self.optimizer
        if self.stage == 3 and self._open:
            saved, self._open = self._saved_boundary, False
            optimizer._coalesce_grad_reduction = False
            engine.inside_no_sync_ctxt = False
            engine._is_gradient_accumulation_boundary = True
            optimizer.set_gradient_accumulation_boundary(True)
            try:
                engine._flush_coalesced_reduction_zero3(optimizer)  # every gradient reduced, in parameter order
            finally:
                engine._is_gradient_accumulation_boundary = saved
        elif self.stage == 2:
            optimizer._coalesce_grad_reduction = False  # the flush drives the very hooks the flag silences
            try:
                engine._flush_coalesced_reduction_zero12(optimizer)
            finally:
                optimizer._coalesce_grad_reduction = True

    def undo(self) -> None:
        """Back to DeepSpeed's own behaviour, without reducing what an abandoned step left (no collective here)."""
        self.optimizer._coalesce_grad_reduction = False
        if self.stage == 3 and self._open:
            self.engine.inside_no_sync_ctxt = False
            self.engine._is_gradient_accumulation_boundary = self._saved_boundary
            self._open = False
        if self.stage == 2:
            self.optimizer.__dict__.pop("overlapping_partition_gradients_reduce_epilogue", None)


# What ParameterOrderReduction uses of DeepSpeed's engine (added with coalesce_grad_reduction, present in 0.19.8).
_COALESCE_API = ("_flush_coalesced_reduction_zero12", "_flush_coalesced_reduction_zero3", "inside_no_sync_ctxt")


class HeteroPrecision(DeepSpeedPrecision):
    """This rank's precision inside an fp32 DeepSpeed engine (see the module docstring).

    Args:
        rank_precision: what this rank computes in: ``"bf16-mixed"``, ``"16-mixed"`` or ``"32-true"``.
        device_type: ``"cpu"`` or ``"cuda"``, for ``torch.autocast``.
        precisions: every rank's precision, in rank order (the decision to scale is the job's).
        gather_flags: all-gathers a one-element tensor from every rank, in rank order.
        device_types: every rank's device type; ranks whose autocast differs (another precision, or the same one on
            another device type, whose autocast casts other operations) produce gradients in another order.
    """

    def __init__(
        self,
        rank_precision: str,
        device_type: str,
        precisions: tuple[str, ...],
        gather_flags: Callable[[Tensor], list[Tensor]],
        loss_scale: Optional[DynamicLossScale] = None,
        device_types: Optional[tuple[str, ...]] = None,
    ) -> None:
        super().__init__(FP32)  # the engine, its master weights and the collectives: fp32 on every rank
        self.rank_precision = rank_precision
        self.precisions = precisions
        self.device_types = device_types or (device_type,) * len(precisions)
        self.autocast = autocast_for(rank_precision, device_type)
        self.loss_scale = (loss_scale or DynamicLossScale()) if needs_loss_scale(precisions) else None
        self._gather_flags = gather_flags
        self._gradients: Optional[UnscaledGradients] = None
        self._undo_skipping: Optional[Callable[[], None]] = None
        self._in_order: Optional[ParameterOrderReduction] = None
        self._skip = False
        # (the trainer's global step, ranks that overflowed, scale before and after): what the run report shows.
        self.overflows: list[dict[str, Any]] = []
        # Whether the ranks agreed that this step's gradients are not finite somewhere that no fp16 rank's gradient
        # hooks see (a pipeline's stage after an fp16 one receives its overflowed gradient): an overflow too. Called
        # once per optimizer step on every rank, where the ranks agree (it may be a collective).
        self.agreed_nonfinite: Callable[[], bool] = lambda: False

    @property
    def skips_this_step(self) -> bool:
        """Every rank agreed to skip the optimizer step under way (an fp16 overflow somewhere)."""
        return self._skip

    def attach(self, engine: Any, device: torch.device) -> None:
        """After DeepSpeed built the engine: the reduction order (mixed ranks), the gradient hooks (fp16 ranks) and
        the agreed skipping (every rank of a job with an fp16 rank)."""
        if engine.optimizer is None:  # not training
            return
        if reduces_in_parameter_order(self.precisions, self.device_types, engine.zero_optimization_stage()):
            self._in_order = ParameterOrderReduction(engine)
        if self.loss_scale is None:
            return
        if self.rank_precision == FP16:
            self._gradients = UnscaledGradients(engine.module.parameters(), device, self.loss_scale)
        self._undo_skipping = skip_agreed_overflows(engine.optimizer, lambda: self._skip)

    def parameters_arrived(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Parameters that joined this rank's module after the engine was built (a pipeline's blocks moved here by a
        re-plan, new tensors): an fp16 rank unscales their gradients too, as it does its own since the start."""
        if self._gradients is not None:
            self._gradients.track(parameters)

    def detach(self) -> None:
        if self._in_order is not None:
            self._in_order.undo()
            self._in_order = None
        if self._gradients is not None:
            self._gradients.remove()
            self._gradients = None
        if self._undo_skipping is not None:
            self._undo_skipping()
            self._undo_skipping = None

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        if self._in_order is not None:
            self._in_order.before_backward()
        if self._gradients is not None and self.loss_scale is not None:
            tensor = tensor * self.loss_scale.scale
        return super().pre_backward(tensor, module)

    @override
    # (ignore: Lightning's own Precision.optimizer_step narrows Fabric's signature the same way, with the same ignore)
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.loss_scale is None and self._in_order is None:
            return super().optimizer_step(optimizer, model, closure, **kwargs)

        def closure_then_reduce() -> Any:
            result = closure()  # forward and backward: the gradients (and any overflow) of this step are known
            if self._in_order is not None:
                self._in_order.before_step()
            if self.loss_scale is not None:
                trainer = getattr(model, "_trainer", None)
                self._agree_on_overflow(trainer.global_step if trainer is not None else None)
            return result

        return super().optimizer_step(optimizer, model, closure_then_reduce, **kwargs)

    def _agree_on_overflow(self, step: Optional[int]) -> None:
        """One all-gather of every rank's overflow count; every rank then takes the same decision."""
        assert self.loss_scale is not None
        local = self._gradients.take_found_inf() if self._gradients is not None else torch.zeros(())
        flags = self._gather_flags(local.reshape(1).float())
        overflowed = [rank for rank, flag in enumerate(flags) if float(flag.item()) > 0]
        nonfinite_elsewhere = self.agreed_nonfinite()  # (on every rank, whatever the flags: it may be a collective)
        scale_before = self.loss_scale.scale
        try:
            self._skip = self.loss_scale.update(bool(overflowed) or nonfinite_elsewhere)
        except FloatingPointError as error:
            raise FloatingPointError(
                f"{error} It happened on rank(s) {overflowed}, which train in '16-mixed'. Give them 'bf16-mixed' (if"
                " the device has it) or '32-true' in `device_precision`."
            ) from None
        if self._skip:
            self.overflows.append(
                {"step": step, "ranks": overflowed, "scale_before": scale_before, "scale": self.loss_scale.scale}
            )

    def summary(self) -> dict[str, Any]:
        """What the run report shows about precision: each rank's, the loss scale and the skipped steps."""
        return {
            "precisions": list(self.precisions),
            "loss_scale": self.loss_scale.scale if self.loss_scale is not None else None,
            "skipped_steps": self.overflows,
        }

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale.state_dict()} if self.loss_scale is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.loss_scale is not None and "loss_scale" in state_dict:
            self.loss_scale.load_state_dict(state_dict["loss_scale"])
