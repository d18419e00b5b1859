"""Per-device precision, the decisions and the single-process parts (no process group)."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from lightning.pytorch.strategies.strategy import _ForwardRedirection

from lightning_hetero.measure.facts import DeviceFacts
from lightning_hetero.precision.choice import (
    BF16,
    FP16,
    FP32,
    DynamicLossScale,
    best_precision,
    check_config_precision,
    check_device_precision,
    check_rank_count,
    check_trainer_precision,
    gradient_order_may_differ,
    needs_loss_scale,
    rank_precision,
    reduces_in_parameter_order,
    slow_precision,
)
from lightning_hetero.precision.plugin import (
    AutocastInside,
    HeteroPrecision,
    ParameterOrderReduction,
    UnscaledGradients,
    skip_agreed_overflows,
)
from lightning_hetero.watch.report import build_report, summary_text


def cuda(capability: tuple[int, int], bf16_runs: bool = True) -> DeviceFacts:
    """As devices.cuda_facts reports a GPU: bf16 runs (emulated below 8.0) unless a bf16 tensor op failed there."""
    return DeviceFacts(
        kind="cuda",
        name="gpu",
        hostname="h",
        compute_capability=capability,
        supports_bf16=bf16_runs,
        bf16_native=capability >= (8, 0),
        supports_fp16=capability >= (5, 3),
    )


def cpu(bf16_native: bool) -> DeviceFacts:
    return DeviceFacts(
        kind="cpu", name="cpu", hostname="h", supports_bf16=True, bf16_native=bf16_native, supports_fp16=True
    )


# ------------------------------------------------------------------------------------------------------- arguments


def test_device_precision_accepts_none_auto_and_one_precision_per_rank_with_lightnings_short_forms():
    assert check_device_precision(None) is None
    assert check_device_precision("auto") == "auto"
    assert check_device_precision(["bf16-mixed", "16-mixed", "32-true"]) == (BF16, FP16, FP32)
    assert check_device_precision(("bf16", 16, "32")) == (BF16, FP16, FP32)


def test_rank_count_and_trainer_and_config_conflicts_name_what_to_drop():
    check_rank_count("auto", 3)
    check_rank_count((BF16, FP32), 2)
    with pytest.raises(ValueError, match=r"has 3 entries but the job has 2 ranks"):
        check_rank_count((BF16, FP32, FP32), 2)
    check_trainer_precision(None, "bf16-mixed", "DeepSpeedPrecision")  # no device_precision: the Trainer's applies
    check_trainer_precision("auto", "32-true", "DeepSpeedPrecision")
    with pytest.raises(ValueError, match=r"`Trainer\(precision='16-mixed'\)` sets one precision .* drop one"):
        check_trainer_precision("auto", "16-mixed", "DeepSpeedPrecision")
    with pytest.raises(ValueError, match=r"given `MyPrecision`: drop that plugin"):
        check_trainer_precision((BF16,), "32-true", "MyPrecision")
    check_config_precision("auto", {"fp16": {"enabled": False}, "zero_optimization": {"stage": 2}})
    check_config_precision(None, {"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"enables `bfloat16`"):
        check_config_precision("auto", {"bfloat16": {"enabled": True}})


# ------------------------------------------------------------------------------------------------------ decisions


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (cuda((9, 0)), BF16),  # H100
        (cuda((8, 0)), BF16),  # A100
        (cuda((7, 0)), FP16),  # V100
        (cuda((7, 5)), FP16),  # T4
        (cuda((5, 0)), FP32),  # no fp16 arithmetic
        (cpu(bf16_native=True), BF16),  # AMX or AVX512-BF16
        (cpu(bf16_native=False), FP32),  # fp16 on a CPU is slow, bf16 emulated too
    ],
)
def test_auto_gives_each_device_the_precision_it_computes_fastest(facts, expected):
    assert best_precision(facts) == expected
    assert rank_precision("auto", 0, facts) == expected


def test_a_precision_the_device_cannot_run_is_refused_naming_the_rank_and_what_it_can_run():
    refusal = r"`device_precision\[1\]='bf16-mixed'` cannot run on rank 1.*capability.* Give that rank '16-mixed'"
    with pytest.raises(ValueError, match=refusal):
        rank_precision((BF16, BF16), 1, cuda((7, 0), bf16_runs=False))
    assert rank_precision((FP32, FP16), 1, cuda((7, 0))) == FP16
    # A V100 runs bf16 by emulation: accepted when asked for, with a warning; never chosen by "auto".
    assert rank_precision((BF16,), 0, cuda((7, 0))) == BF16 and rank_precision("auto", 0, cuda((7, 0))) == FP16
    assert "16-mixed' is its fast precision" in slow_precision(BF16, cuda((7, 0)))
    assert slow_precision(FP16, cpu(True)) and slow_precision(BF16, cpu(False))
    assert slow_precision(BF16, cpu(True)) is None and slow_precision(FP16, cuda((7, 0))) is None
    assert slow_precision(BF16, cuda((8, 0))) is None


def test_gradient_order_is_forced_only_where_the_ranks_autocasts_differ():
    assert gradient_order_may_differ((BF16, FP32), ("cpu", "cpu"))
    assert gradient_order_may_differ((BF16, FP16), ("cuda", "cuda"))
    assert gradient_order_may_differ((BF16, BF16), ("cpu", "cuda"))  # CPU and CUDA autocast cast other operations
    assert not gradient_order_may_differ((BF16, BF16, BF16), ("cuda",) * 3)
    assert not gradient_order_may_differ((FP32, FP32), ("cpu", "cuda"))
    assert reduces_in_parameter_order((BF16, FP32), ("cpu", "cpu"), 2)
    assert reduces_in_parameter_order((BF16, FP32), ("cpu", "cpu"), 3)
    assert not reduces_in_parameter_order((BF16, FP32), ("cpu", "cpu"), 1)  # ZeRO-0/1 reduce in order at the step
    assert not reduces_in_parameter_order((BF16, BF16), ("cuda", "cuda"), 3)


def test_only_jobs_with_an_fp16_rank_pay_for_the_agreed_loss_scale():
    for precisions in itertools.product((BF16, FP16, FP32), repeat=3):
        assert needs_loss_scale(precisions) == (FP16 in precisions)


def test_the_loss_scale_halves_on_overflow_grows_after_a_quiet_interval_and_gives_up_at_its_minimum():
    scale = DynamicLossScale(scale=8.0, growth_interval=3, min_scale=2.0)
    assert [scale.update(overflow) for overflow in (False, True, False, False, False)] == [False, True] + [False] * 3
    assert scale.scale == 8.0  # 8 -> 4 on the overflow -> 8 after three quiet steps
    assert scale.good_steps == 0 and scale.skipped_steps == 1
    assert scale.update(True) and scale.update(True) and scale.scale == 2.0
    with pytest.raises(FloatingPointError, match="minimum loss scale 2"):
        scale.update(True)
    restored = DynamicLossScale()
    restored.load_state_dict(scale.state_dict())
    assert restored == scale


# ---------------------------------------------------------------------------------------------- running parts


def test_unscaled_gradients_equal_the_unscaled_backward_and_count_non_finite_ones():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    layer(x).sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    gradients = UnscaledGradients(layer.parameters(), torch.device("cpu"), DynamicLossScale(scale=1024.0))
    (layer(x).sum() * 1024.0).backward()
    assert all(torch.allclose(p.grad, e) for p, e in zip(layer.parameters(), expected))
    assert gradients.take_found_inf().item() == 0
    (layer(x).sum() * math.inf).backward()
    assert gradients.take_found_inf().item() == 2  # weight and bias
    assert gradients.take_found_inf().item() == 0  # taken: reset
    gradients.remove()
    layer.zero_grad()
    (layer(x).sum() * 2.0).backward()
    assert torch.allclose(layer.bias.grad, 2 * expected[1])  # the hooks are gone


def test_a_skipped_zero0_step_leaves_parameters_and_optimizer_state_untouched():
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(layer.parameters())
    skip = [True]
    undo = skip_agreed_overflows(optimizer, lambda: skip[0])
    before = [p.detach().clone() for p in layer.parameters()]
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert optimizer.overflow and not optimizer.state
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))
    skip[0] = False
    optimizer.step()
    assert not optimizer.overflow and optimizer.state
    undo()
    assert "step" not in optimizer.__dict__ and not hasattr(optimizer, "overflow")


def test_a_learning_rate_scheduler_still_counts_the_steps_of_a_skippable_zero0_step():
    """torch's scheduler marks the `step` it wraps; the skippable step keeps the mark (without it every fit with a
    scheduler warned that `optimizer.step()` "has been overridden"), and undoing it leaves the scheduler's wrapper."""
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(layer.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scheduler_step = optimizer.step
    undo = skip_agreed_overflows(optimizer, lambda: False)
    layer(torch.ones(1, 2)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the warning, or "lr_scheduler.step() before optimizer.step()")
        optimizer.step()
        scheduler.step()
    undo()
    assert optimizer.step == scheduler_step


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, x):
        return self(x).dtype, torch.is_autocast_enabled("cpu")


class _Wrapper(torch.nn.Module):  # resets CPU autocast on entry, as DeepSpeed's engine does CUDA's
    def __init__(self, module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args):
        with torch.autocast("cpu", enabled=False):
            return self.module(*args)


def test_autocast_reaches_the_step_inside_a_wrapper_that_resets_it_and_the_method_is_restored():
    module = _Module()
    wrapper = _Wrapper(module)
    redirect = AutocastInside(_ForwardRedirection(), lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what an autocast outside the engine would achieve: nothing
        assert _ForwardRedirection()(wrapper, module, "training_step", torch.ones(1, 2)) == (torch.float32, False)
    assert redirect(wrapper, module, "training_step", torch.ones(1, 2)) == (torch.bfloat16, True)
    assert "training_step" not in module.__dict__


def test_the_loss_scale_is_saved_and_restored_with_the_plugin_and_the_report_says_what_was_skipped():
    plugin = HeteroPrecision(FP16, "cpu", (FP16, FP32), gather_flags=lambda t: [t])
    plugin.loss_scale.update(True)
    state = plugin.state_dict()
    fresh = HeteroPrecision(FP32, "cpu", (FP16, FP32), gather_flags=lambda t: [t])
    fresh.load_state_dict(state)
    assert fresh.loss_scale == plugin.loss_scale and fresh.loss_scale.scale == 2.0**15
    assert HeteroPrecision(BF16, "cpu", (BF16, FP32), gather_flags=lambda t: [t]).state_dict() == {}
    summary = {"precisions": [FP16, FP32], "loss_scale": 2.0**15, "skipped_steps": [{"step": 3, "ranks": [0]}]}
    steps = [
        {"step": 0, "batch_sizes": [8, 8], "compute_seconds": [1.0, 1.0], "wait_seconds": [0, 0], "step_seconds": 1.0}
    ]
    text = summary_text(build_report(steps, [], 2, precision=summary))
    assert "fp16 loss scale 32768, 1 step skipped on every rank" in text


class _FakeZero3Engine:
    """What ParameterOrderReduction touches of a ZeRO-3 engine; a flush records itself (it would communicate)."""

    def __init__(self) -> None:
        self.optimizer = type("Optimizer", (), {"_coalesce_grad_reduction": False})()
        self.optimizer.set_gradient_accumulation_boundary = lambda value: None
        self.inside_no_sync_ctxt = False
        self._is_gradient_accumulation_boundary = None
        self.flushes: list[str] = []

    def zero_optimization_stage(self) -> int:
        return 3

    def _flush_coalesced_reduction_zero3(self, optimizer) -> None:
        self.flushes.append("zero3")

    def _flush_coalesced_reduction_zero12(self, optimizer) -> None:
        self.flushes.append("zero12")


def test_parameter_order_reduction_flushes_once_per_step_and_never_when_a_step_is_abandoned():
    engine = _FakeZero3Engine()
    order = ParameterOrderReduction(engine)
    order.before_backward()
    order.before_backward()  # gradient accumulation: the same step
    assert engine.optimizer._coalesce_grad_reduction and engine.inside_no_sync_ctxt
    order.before_step()
    assert engine.flushes == ["zero3"] and not engine.optimizer._coalesce_grad_reduction
    assert engine._is_gradient_accumulation_boundary is None  # restored after the flush
    order.before_backward()
    order.undo()  # a failure between two backward passes: back to DeepSpeed's state with no collective
    assert engine.flushes == ["zero3"]
    assert not engine.optimizer._coalesce_grad_reduction and not engine.inside_no_sync_ctxt


def test_fp16_loss_scale_arguments_that_do_nothing_are_said():
    """DeepSpeedStrategy writes `loss_scale`, `initial_scale_power`... into DeepSpeed's fp16 section only with an fp16
    precision and no `fp16` section of the config's own, and drops them silently otherwise: a test reading
    `config["fp16"]` failed with a bare KeyError (issue 51, item 3). Where they do nothing, the warning names them."""
    from lightning_hetero.precision.choice import unused_fp16_arguments

    given = {"loss_scale": 10, "initial_scale_power": 11}
    assert unused_fp16_arguments({}, "bf16-mixed", {}) is None
    assert unused_fp16_arguments(given, "16-mixed", {}) is None  # (DeepSpeed's fp16 section gets them)
    bf16 = unused_fp16_arguments(given, "bf16-mixed", {})
    assert bf16 is not None and "`loss_scale=10`, `initial_scale_power=11` set DeepSpeed's fp16 loss scaling" in bf16
    assert "`precision='bf16-mixed'` runs no fp16 engine" in bf16
    own = unused_fp16_arguments(given, "16-mixed", {"fp16": {"enabled": True}})
    assert own is not None and "has its own `fp16` section, which wins" in own
