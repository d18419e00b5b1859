"""Train: a model split into pipeline stages (``HeteroStrategy(pipeline={"stages": S, "blocks": "net"})``), run.

:class:`Pipeline` is this rank's place in the pipelines (:class:`PipelineLayout`): it installs the rank's stage of the
chain, runs each step's schedule over the micro-batches (:func:`schedule_actions`), exchanging activations and
gradients with the neighbouring stages, sums the gradients after it, and moves blocks when the stages are re-planned.
The contract with the user's module (the chain, what runs on which stage, what is refused) is in
:mod:`lightning_hetero.pipeline.chain`; the last stages' logging in
:mod:`lightning_hetero.pipeline.last_stage_metrics`.

The modules outside the chain are held by every rank, whole; their gradients are summed over every rank (only the
first and last stages give them any), so they stay equal everywhere. A block's gradients are summed over the pipelines
that hold its stage. Each micro-batch's loss is weighted by its share of the global batch, so the update is the one of
one process on the whole batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_hetero.comm.point_to_point import PeerLink
from lightning_hetero.pipeline.chain import HandOff, StageOfChain, block_of, find_chain
from lightning_hetero.pipeline.last_stage_metrics import log_synced_over
from lightning_hetero.pipeline.options import PipelineChoice
from lightning_hetero.pipeline.placement import StagePlacement
from lightning_hetero.split.decisions.split import micro_batch_sizes
from lightning_hetero.train.gradient_norm import clip_to_norm, squared_norm
from lightning_hetero.train.micro_batches import split_batch, step_loss


def schedule_actions(schedule: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s forward ("F") and backward ("B") passes over the micro-batches of one step, in order.

    GPipe: every forward, then every backward. 1F1B: ``stages - stage - 1`` forwards to fill the pipeline, then one
    forward and one backward in turn, then the backward passes left; a stage holds at most ``stages - stage``
    micro-batches' activations."""
    if schedule == "gpipe":
        return [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]
    warm_up = min(stages - stage - 1, micro_batches)
    actions = [("F", m) for m in range(warm_up)]
    for index in range(micro_batches - warm_up):
        actions += [("F", warm_up + index), ("B", index)]
    actions += [("B", m) for m in range(micro_batches - warm_up, micro_batches)]
    return actions


def interleaved_actions(stage: int, stages: int, micro_batches: int, chunks: int) -> list[tuple[str, int, int]]:
    """Stage ``stage``'s passes ``(kind, micro-batch, chunk)`` under the interleaved schedule with ``chunks`` chunks per
    stage (Megatron-LM's interleaved 1F1B): the micro-batches go round the stages in groups of ``stages``, each group
    through chunk 0 of every stage, then chunk 1...; a warm-up of ``2 (stages - stage - 1) + (chunks - 1) stages``
    forwards, then one forward and one backward in turn, then the backwards left. The bubble shrinks by ``chunks``
    against 1F1B's, for ``chunks`` times the hand-offs.

    When ``micro_batches`` is not a multiple of ``stages`` (an epoch's short last batch) that order can deadlock, so the
    step runs GPipe's order over the chunks instead (every forward, then every backward), which cannot."""
    groups = [range(first, min(first + stages, micro_batches)) for first in range(0, micro_batches, stages)]
    forwards = [(m, v) for group in groups for v in range(chunks) for m in group]
    backwards = [(m, v) for group in groups for v in reversed(range(chunks)) for m in group]
    total = micro_batches * chunks
    if micro_batches % stages:
        return [("F", m, v) for m, v in forwards] + [("B", m, v) for m, v in backwards]
    warm_up = min(total, 2 * (stages - stage - 1) + (chunks - 1) * stages)
    actions = [("F", *forwards[k]) for k in range(warm_up)]
    for index in range(total - warm_up):
        actions += [("F", *forwards[warm_up + index]), ("B", *backwards[index])]
    actions += [("B", *backwards[k]) for k in range(total - warm_up, total)]
    return actions


def stage_actions(choice: PipelineChoice, stage: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """This stage's passes ``(kind, micro-batch, chunk)`` in one step under ``choice``'s schedule."""
    if choice.schedule == "interleaved":
        return interleaved_actions(stage, choice.stages, micro_batches, choice.virtual_stages)
    return [(kind, m, 0) for kind, m in schedule_actions(choice.schedule, stage, choice.stages, micro_batches)]


@dataclass(frozen=True)
class PipelineLayout:
    """Which rank runs which stage of which pipeline: pipeline ``p`` is ranks ``p*S .. p*S+S-1``, its stage ``s`` on
    ``p*S + order[s]`` (the placement's order of the first pipeline's ranks). Rank 0 runs the last stage of the first
    pipeline: the rest of ``training_step`` (its ``self.log`` calls) runs there, and Lightning's loggers write rank
    0's metrics."""

    stages: int
    replicas: int
    order: tuple[int, ...]

    def rank_of(self, replica: int, stage: int) -> int:
        return replica * self.stages + self.order[stage]

    def stage_of(self, rank: int) -> int:
        return self.order.index(rank % self.stages)

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage``, one per pipeline: the group over which its blocks' gradients are summed."""
        return [self.rank_of(p, stage) for p in range(self.replicas)]


class Pipeline:
    """This rank's place in the pipelines, the schedule it runs each step and the gradient sums after it."""

    def __init__(self, choice: PipelineChoice, rank: int, world_size: int, device: torch.device, timeout: float):
        self.choice, self.rank, self.world_size, self.device = choice, rank, world_size, device
        self.link = PeerLink(device, timeout)
        self.layout: Optional[PipelineLayout] = None
        self.stage_of_chain: Optional[StageOfChain] = None
        self.placement: Optional[StagePlacement] = None
        self.outside: list[nn.Parameter] = []
        self._stage_group: Any = None
        self.global_batch = 0
        # Per step: this stage's compute (forward and backward, emulated speed included) and its time waiting for
        # a neighbour (the bubble, and any imbalance), in seconds of wall time.
        self.step_times: list[tuple[float, float]] = []
        self._held: list[tuple[nn.Parameter, Optional[Tensor]]] = []
        self._unpatch_log: Callable[[], None] = lambda: None
        self._skeletons: dict[int, nn.Module] = {}
        self.shares: tuple[int, ...] = ()  # each pipeline's samples of a global batch (set by the plan)

    # ------------------------------------------------------------------ setup

    @property
    def stage(self) -> int:
        assert self.layout is not None
        return self.layout.stage_of(self.rank)

    @property
    def replica(self) -> int:
        assert self.layout is not None
        return self.layout.replica_of(self.rank)

    @property
    def replicas(self) -> int:
        assert self.layout is not None
        return self.layout.replicas

    @property
    def stage_group(self) -> Any:
        """The process group of the ranks holding this rank's stage, one per pipeline (None with one pipeline)."""
        return self._stage_group

    @property
    def is_last(self) -> bool:
        return self.stage == self.choice.stages - 1

    def replica_batch_sizes(self) -> list[int]:
        """Each pipeline's share of the global batch (:attr:`shares`, set by the plan)."""
        assert self.shares, "the plan sets the pipelines' shares before any loader is cut"
        return list(self.shares)

    def install(self, module: LightningModule, placement: StagePlacement, replicas: int, global_batch: int) -> None:
        """Keep this rank's stage of the chain; build the groups (every rank, the same calls in the same order)."""
        chain, names = find_chain(module, self.choice.blocks)
        self.layout = PipelineLayout(self.choice.stages, replicas, tuple(placement.ranks))
        self.placement, self.global_batch = placement, global_batch
        chain_parameters = {id(p) for p in chain.parameters()}
        self.outside = [p for p in module.parameters() if id(p) not in chain_parameters]
        owned = placement.blocks_of(self.stage)
        # The blocks other stages hold, kept without storage ("meta"): a re-plan that moves one here fills it in.
        self._skeletons = {i: block_of(chain, n) for i, n in enumerate(names) if i not in owned}
        self.stage_of_chain = StageOfChain(
            chain, names, owned, self.stage, self.choice.stages, self.choice.blocks, placement.chunks_of(self.stage)
        )
        self.stage_of_chain.install()
        for skeleton in self._skeletons.values():
            skeleton.to("meta")
        if replicas > 1:
            groups = [self.layout.stage_ranks(s) for s in range(self.choice.stages)]
            self._stage_group, _ = dist.new_subgroups_by_enumeration(groups)
        # Only the last stages log (the rest of training_step runs there): `self.log(..., sync_dist=True)` reduces
        # over them alone, not over ranks that never log (which would leave the last stages waiting).
        last_stages = dist.new_group(self.layout.stage_ranks(self.choice.stages - 1))
        if self.is_last:
            self._unpatch_log = log_synced_over(module, last_stages)
        self._broadcast_initial_parameters()

    def _broadcast_initial_parameters(self) -> None:
        """What DeepSpeed's engine does for a data-parallel model, per part: the modules outside the chain from rank
        0 to every rank, each stage's blocks from the first pipeline to the others."""
        assert self.layout is not None and self.stage_of_chain is not None
        with torch.no_grad():
            for parameter in self.outside:
                dist.broadcast(parameter.data, src=0)
            if self._stage_group is not None:
                source = self.layout.rank_of(0, self.stage)
                for parameter in self.stage_of_chain.parameters():
                    dist.broadcast(parameter.data, src=source, group=self._stage_group)

    def uninstall(self) -> None:
        if self.stage_of_chain is not None:
            self.stage_of_chain.uninstall()
        self._unpatch_log()
        self._unpatch_log = lambda: None

    # ------------------------------------------------------------------ a step

    def micro_batches_of(self, batch: Any, samples: int) -> list[tuple[Any, int]]:
        sizes = micro_batch_sizes(samples, self.choice.micro_batches_for(samples))
        return list(zip(split_batch(batch, sizes), sizes))

    def run_step(
        self,
        micro_batches: Sequence[tuple[Any, int]],
        forward: Callable[[Any, int], Any],
        weight_of: Callable[[int], float],
        slowed: Callable[[], contextlib.AbstractContextManager],
        backward: Callable[[Tensor], None],
        accumulated: int = 1,
        loss_scale: float = 1.0,
    ) -> Tensor:
        """One step's schedule on this stage; returns the global batch's loss (the same on every rank).

        ``forward(batch, samples)`` runs the user's ``training_step`` on one micro-batch; ``weight_of(samples)`` is
        its loss's factor; ``slowed()`` bounds the local compute (the emulated device's speed); ``backward(scalar)``
        is the engine's backward (DeepSpeed refuses a direct ``tensor.backward()``): a stage before the last runs it
        on ``(output * received_gradient).sum()``, whose gradients are those of the output's backward with it.
        ``accumulated``: the Trainer's ``accumulate_grad_batches``; the last stage's backward divides each loss by it
        (as Lightning's closure divides a step's loss), the returned loss does not. ``loss_scale``: an fp16 stage's
        (else 1): its backward is multiplied by it, and the gradient it sends to the stage before divided by it."""
        assert self.layout is not None and self.stage_of_chain is not None
        stage_of_chain = self.stage_of_chain
        inputs: dict[tuple[int, int], Tensor] = {}
        outputs: dict[tuple[int, int], Tensor] = {}
        total = torch.zeros((), dtype=torch.float64)
        compute = 0.0
        step_started = time.perf_counter()
        for kind, m, v in stage_actions(self.choice, self.stage, len(micro_batches)):
            previous, following = self._neighbours(v)
            if kind == "F":
                if previous is not None:
                    what = f"micro-batch {m}'s activation" + (f" (chunk {v})" if v else "")
                    received = self.link.receive(previous, what, self._key("A", m, v)).requires_grad_()
                    inputs[(m, v)] = received
                    stage_of_chain.incoming = received
                stage_of_chain.pass_starts()
                batch, samples = micro_batches[m]
                started = time.perf_counter()
                with slowed(), stage_of_chain.running(v):
                    output = self._forward(forward, batch, samples, following is not None)
                compute += time.perf_counter() - started
                if following is not None:
                    to = v if stage_of_chain.stage < self.choice.stages - 1 else v + 1  # (the chunk it feeds)
                    what = f"micro-batch {m}'s activation" + (f" (chunk {v})" if v else "")
                    self.link.send(output, following, what, self._key("A", m, to))
                    outputs[(m, v)] = output
                else:
                    loss = step_loss(output)
                    if not isinstance(loss, Tensor):
                        raise RuntimeError(
                            "HeteroStrategy(pipeline=...): `training_step` returned no loss on the last stage; a"
                            " pipeline cannot skip a micro-batch (the other stages already ran it)."
                        )
                    weighted = loss * weight_of(samples)
                    total += weighted.detach().double().cpu()
                    outputs[(m, v)] = weighted / accumulated if accumulated > 1 else weighted
            else:
                gradient = None
                if following is not None:
                    what = f"micro-batch {m}'s gradient" + (f" (chunk {v})" if v else "")
                    gradient = self.link.receive(following, what, self._key("G", m, v))
                started = time.perf_counter()
                with slowed():
                    output = outputs.pop((m, v))
                    scalar = output if gradient is None else (output * gradient.to(output.dtype)).sum()
                    backward(scalar * loss_scale if loss_scale != 1.0 else scalar)
                compute += time.perf_counter() - started
                if previous is not None:
                    received = inputs.pop((m, v))
                    grad = received.grad if received.grad is not None else torch.zeros_like(received)
                    if loss_scale != 1.0:
                        grad = grad / loss_scale  # (an inf from an fp16 overflow stays inf: every stage skips)
                    to = v if stage_of_chain.stage > 0 else v - 1  # (the chunk whose output it is the gradient of)
                    what = f"micro-batch {m}'s gradient" + (f" (chunk {v})" if v else "")
                    self.link.send(grad, previous, what, self._key("G", m, to))
        self.link.flush()
        self.step_times.append((compute, time.perf_counter() - step_started - compute))
        # The last stages' weighted losses: the global batch's loss, on every rank (on the device: NCCL moves only
        # CUDA tensors).
        total = total.to(self.device)
        dist.all_reduce(total)
        return total.float()

    def _neighbours(self, chunk: int) -> tuple[Optional[int], Optional[int]]:
        """The ranks chunk ``chunk`` of this stage receives its input from and hands its output to (None: the chain's
        start or end). With chunks, the last stage's chunk ``v`` feeds the first stage's chunk ``v + 1``."""
        assert self.layout is not None and self.stage_of_chain is not None
        stage, stages, replica = self.stage, self.choice.stages, self.replica
        takes, hands = self.stage_of_chain.takes_input(chunk), self.stage_of_chain.hands_off(chunk)
        previous = self.layout.rank_of(replica, (stage - 1) % stages) if takes else None
        following = self.layout.rank_of(replica, (stage + 1) % stages) if hands else None
        return previous, following

    def _key(self, kind: str, micro_batch: int, chunk: int) -> int:
        """The key of an activation ("A", into ``chunk``) or a gradient ("G", of ``chunk``'s output) of one
        micro-batch between two ranks, unique within a step (see
        :class:`~lightning_hetero.comm.point_to_point.PeerLink`)."""
        return (("A", "G").index(kind) * 64 + chunk) * 2**32 + micro_batch

    def evaluation_step(self, batch: Any, forward: Callable[[Any], Any]) -> Any:
        """``forward(batch)`` (the user's validation step) through the stages, the whole batch at once: the last
        stage's output; None on the others (their part of the step ends at their hand-off)."""
        assert self.layout is not None and self.stage_of_chain is not None
        stage_of_chain = self.stage_of_chain
        for chunk in range(len(stage_of_chain.chunks)):
            previous, following = self._neighbours(chunk)
            if previous is not None:
                stage_of_chain.incoming = self.link.receive(previous, "an evaluation batch's activation")
            stage_of_chain.pass_starts()
            with stage_of_chain.running(chunk):
                output = self._forward(lambda b, _: forward(b), batch, 0, following is not None)
            if following is None:
                self.link.flush()  # (the last stage's earlier chunks sent theirs)
                return output
            self.link.send(output, following, "an evaluation batch's activation")
        self.link.flush()
        return None

    def _forward(self, forward: Callable[[Any, int], Any], batch: Any, samples: int, hands_off: bool) -> Any:
        try:
            output = forward(batch, samples)
        except HandOff as hand_off:
            return hand_off.output
        if hands_off:
            raise RuntimeError(
                f"HeteroStrategy(pipeline=...): `training_step` ended without running stage {self.stage}'s last"
                f" block of `{self.choice.blocks}`. The chain must run in every training step."
            )
        return output

    def move_blocks(self, placement: StagePlacement, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
        """Take the re-planned ``placement``'s blocks: every rank sends the blocks it gives away (their parameters,
        buffers and optimizer state) to every rank, each takes the ones it gets and drops the others; at a step
        boundary, so the next step trains as if nothing moved (the same values, the same optimizer state). Every
        rank calls it with the same placement (the decision is made from gathered values). Returns the parameters that
        arrived here (new tensors: hooks on the parameters that were here before do not reach them)."""
        assert self.stage_of_chain is not None and self.placement is not None
        chain, names = self.stage_of_chain.chain, self.stage_of_chain.names
        old, new = self.placement.blocks_of(self.stage), placement.blocks_of(self.stage)
        giving, taking = moved_blocks(old, new)
        outgoing = {}
        for index in giving:
            block = block_of(chain, names[index])
            state = {local: _cpu(optimizer.state.get(p, {})) for local, p in block.named_parameters()}
            outgoing[index] = ({k: v.detach().cpu() for k, v in block.state_dict().items()}, state)
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, outgoing)
        # Every pipeline's copy of a stage gives the same blocks: their parameters are equal, and their optimizer
        # state is the union of what each copy held (all of it, or with `stage=1` the parameters each copy owned).
        arriving: dict[int, tuple[dict[str, Tensor], dict[str, Any]]] = {}
        for sent in everyone:
            for index, (model_state, optimizer_state) in sent.items():
                _, merged = arriving.setdefault(index, (model_state, {}))
                for local, value in optimizer_state.items():
                    if value or local not in merged:
                        merged[local] = value
        self.stage_of_chain.uninstall()
        group = optimizer.param_groups[0]
        for index in giving:
            block = block_of(chain, names[index])
            lost = {id(p) for p in block.parameters()}
            for parameter in block.parameters():
                optimizer.state.pop(parameter, None)
            group["params"] = [p for p in group["params"] if id(p) not in lost]
            self._skeletons[index] = block.to("meta")
        arrived: list[nn.Parameter] = []
        for index in taking:
            block = self._skeletons.pop(index).to_empty(device=self.device)
            model_state, optimizer_state = arriving[index]
            block.load_state_dict(model_state)
            chain._modules[names[index]] = block
            for local, parameter in block.named_parameters():
                group["params"].append(parameter)
                arrived.append(parameter)
                if optimizer_state.get(local):
                    optimizer.state[parameter] = {k: _to(v, self.device) for k, v in optimizer_state[local].items()}
        self.stage_of_chain = StageOfChain(chain, names, new, self.stage, self.choice.stages, self.choice.blocks)
        self.stage_of_chain.install()
        self.placement = placement
        return arrived

    def reduce_gradients(self) -> None:
        """Sum each block's gradients over the pipelines holding its stage, and the outside modules' over every
        rank (so every copy of them takes the same step)."""
        assert self.stage_of_chain is not None
        if self._stage_group is not None:
            _sum_gradients(self.stage_of_chain.parameters(), self._stage_group)
        if self.world_size > 1 and self.outside:
            _sum_gradients(self.outside, None)

    def set_aside_gradients(self, module: nn.Module) -> list[tuple[nn.Parameter, Tensor]]:
        """Take the gradients accumulated by earlier batches of an optimizer step off the parameters, so that this
        batch's sums (:meth:`reduce_gradients`) add its own gradients only; :meth:`add_back` adds them again."""
        earlier = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        for parameter, _ in earlier:
            parameter.grad = None
        return earlier

    @staticmethod
    def add_back(earlier: Sequence[tuple[nn.Parameter, Tensor]]) -> None:
        for parameter, grad in earlier:
            parameter.grad = grad if parameter.grad is None else parameter.grad + grad

    def gradient_norm(self) -> float:
        """The whole model's gradient norm, the same on every rank: the squared norm summed over the stages in one
        all-reduce, each stage counted once (by its first pipeline: the pipelines holding a stage hold the same summed
        gradients) and the modules outside the chain once (by rank 0: every rank holds them equal)."""
        assert self.stage_of_chain is not None
        counted = list(self.stage_of_chain.parameters()) if self.replica == 0 else []
        if self.rank == 0:
            counted += self.outside
        squares = squared_norm(counted, self.device)
        dist.all_reduce(squares)
        return float(squares.sqrt())

    @staticmethod
    def clip_gradients(module: nn.Module, max_norm: float, norm: float) -> None:
        """Scale every gradient by one factor so that the whole model's gradient ``norm`` (:meth:`gradient_norm`)
        is at most ``max_norm``, as one process's ``torch.nn.utils.clip_grad_norm_`` on the whole model."""
        clip_to_norm(module.parameters(), max_norm, norm)

    def hold_gradients(self, module: nn.Module) -> None:
        """Take the step's gradients off the parameters: Lightning zeroes them between ``training_step`` (where the
        schedule ran every backward) and ``backward``, which hands them back (:meth:`return_gradients`)."""
        self._held = [(p, p.grad) for p in module.parameters() if p.grad is not None]
        for parameter, _ in self._held:
            parameter.grad = None

    def return_gradients(self) -> None:
        for parameter, grad in self._held:
            parameter.grad = grad
        self._held = []


def moved_blocks(old: Sequence[int], new: Sequence[int]) -> tuple[list[int], list[int]]:
    """The blocks a stage gives away and the ones it takes when its range changes from ``old`` to ``new``."""
    return [b for b in old if b not in new], [b for b in new if b not in old]


def _sum_gradients(parameters: Sequence[nn.Parameter], group: Any) -> None:
    trained = [p for p in parameters if p.requires_grad]
    if not trained:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trained]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for parameter, grad in zip(trained, grads):
        count = grad.numel()
        parameter.grad = flat[offset : offset + count].view_as(grad).clone()
        offset += count


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in state.items()}


def _to(value: Any, device: torch.device) -> Any:
    # (a 0-d tensor is an optimizer's step count, which torch's optimizers keep on the CPU)
    return value.to(device) if isinstance(value, Tensor) and value.dim() > 0 else value
