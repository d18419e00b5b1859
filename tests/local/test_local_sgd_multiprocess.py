"""Local SGD and DiLoCo end to end on two CPU ranks, against a plain-torch reference of the same algorithm.

The claims under test: with one synchronization per step and one inner step per rank, local SGD (and DiLoCo with an
outer SGD of lr 1 and no momentum) is synchronous SGD on the same global batches; with unequal inner steps every
sample is used once and the parameters are the reference's; a resume from a checkpoint at a synchronization equals
the uninterrupted run.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parents[1]))

from common import IndexedRegression, batch_loss, make_network, max_param_difference, reference_training  # noqa: E402
from conftest import run_fit  # noqa: E402
from test_strategy_multiprocess import contiguous_steps  # noqa: E402

from lightning_hetero.comm.quantize import wire_bytes  # noqa: E402
from lightning_hetero.local.fragments import due_fragments  # noqa: E402
from lightning_hetero.split.decisions.split import micro_batch_sizes  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5


def inner_training_step(
    dataset: IndexedRegression,
    step: list[int],
    micro: list[int],
    inner: list[int],
    nets: list[torch.nn.Module],
    inner_optimizers: list[torch.optim.Optimizer],
) -> list[int]:
    """One training step of the references: each rank takes its contiguous slice of the global batch in ``inner[r]``
    SGD steps of its own. Returns the samples each rank trained on."""
    trained, begin = [], 0
    for rank, (net, optimizer) in enumerate(zip(nets, inner_optimizers)):
        share = step[begin : begin + micro[rank] * inner[rank]]
        begin += len(share)
        offset = 0
        for size in micro_batch_sizes(len(share), inner[rank]):
            indices = share[offset : offset + size]
            offset += size
            optimizer.zero_grad()
            batch_loss(net, dataset.x[indices], dataset.y[indices]).backward()
            optimizer.step()
        trained.append(len(share))
    return trained


def local_reference(
    dataset: IndexedRegression,
    steps: list[list[int]],
    micro: list[int],
    inner: list[int],
    sync_at: set[int],
    outer: Optional[dict[str, Any]] = None,
    lr: float = 0.05,
    momentum: float = 0.9,
) -> dict[str, torch.Tensor]:
    """Each rank takes its contiguous slice of every global batch in ``inner[r]`` SGD steps of its own; after the
    training steps in ``sync_at`` (counted from 1) the ranks merge their deltas weighted by their samples."""
    start = make_network()
    nets = [copy.deepcopy(start) for _ in micro]
    inner_optimizers = [torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum) for net in nets]
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in start.parameters()]
    outer_optimizer = None
    if outer is not None:
        outer_optimizer = torch.optim.SGD(
            anchor, lr=outer["outer_lr"], momentum=outer["outer_momentum"], nesterov=outer["nesterov"]
        )
    samples = [0] * len(micro)
    for number, step in enumerate(steps, start=1):
        for rank, trained in enumerate(inner_training_step(dataset, step, micro, inner, nets, inner_optimizers)):
            samples[rank] += trained
        if number in sync_at:
            total = sum(samples)
            with torch.no_grad():
                for index, parameter in enumerate(anchor):
                    average = sum(
                        (n / total) * (parameter - list(net.parameters())[index]) for n, net in zip(samples, nets)
                    )
                    if outer_optimizer is None:
                        parameter -= average
                    else:
                        parameter.grad = average.clone()
            if outer_optimizer is not None:
                outer_optimizer.step()
                outer_optimizer.zero_grad()
            with torch.no_grad():
                for net in nets:
                    for own, merged in zip(net.parameters(), anchor):
                        own.copy_(merged)
            samples = [0] * len(micro)
    names = [name for name, _ in start.named_parameters()]
    return {name: parameter.detach().clone() for name, parameter in zip(names, anchor)}


def local_args(sync: str, batch_sizes: list[int], **strategy: Any) -> list[str]:
    arguments = json.dumps({"sync": sync, **strategy})
    return ["--stage", "0", "--batch-sizes", *map(str, batch_sizes), "--strategy-args", arguments]


@pytest.mark.parametrize(
    "sync, options",
    [("local_sgd", {}), ("diloco", {"sync_options": {"outer_lr": 1.0, "outer_momentum": 0.0}})],
)
def test_one_synchronization_per_step_is_synchronous_sgd(sync, options, tmp_path):
    """Uneven micro-batches 3/13, one inner SGD-with-momentum step each, merged every step weighted 3/16 and 13/16:
    the update is one process's on the global batch of 16 (momentum too: the weighted average is linear)."""
    run = run_fit(tmp_path, *local_args(sync, [3, 13], sync_every=1, inner_steps=[1, 1], **options), "--max-steps", "4")
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["global_step"] == 4
    steps = contiguous_steps(64, 16, 4)
    assert max_param_difference(run.result, reference_training(IndexedRegression(64), steps)) <= TOLERANCE
    report = json.loads((tmp_path / "hetero" / "report.json").read_text())
    # Every step exchanged the sample counts and the weighted deltas (fp32), and nothing else.
    assert all(step["intra_node_bytes"][0] > 0 for step in report["steps"])


def test_a_fast_rank_takes_more_inner_steps_every_sample_once_and_diloco_as_the_reference(tmp_path):
    """Rank 0 takes 2 inner steps of 4 samples per training step, rank 1 one: 60 samples in 5 steps of 12;
    DiLoCo (outer lr 0.7, Nesterov momentum 0.9) merges after steps 2 and 4 and at the epoch's end (step 5)."""
    run = run_fit(tmp_path, *local_args("diloco", [4, 4], sync_every=2, inner_steps=[2, 1]), "--samples", "60")
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["global_step"] == 5
    assert sorted(sum(run.result["seen"], [])) == list(range(60))  # every sample once
    assert [len(seen) for seen in run.result["seen"]] == [40, 20]  # the fast rank did twice the work
    steps = [list(range(b, b + 12)) for b in range(0, 60, 12)]
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
    reference = local_reference(IndexedRegression(60), steps, [4, 4], [2, 1], {2, 4, 5}, outer)
    assert max_param_difference(run.result, reference) <= TOLERANCE
    assert "inner steps" in run.output and "diloco: each rank trains on its own, inner steps" in run.output


def test_a_resume_at_a_synchronization_equals_the_uninterrupted_run(tmp_path):
    """The checkpoint after step 2 (a synchronization) carries each rank's own momentum and DiLoCo's outer momentum:
    the resumed run ends where the uninterrupted one does."""
    arguments = local_args("diloco", [4, 4], sync_every=2, inner_steps=[2, 1])
    first = run_fit(tmp_path / "first", *arguments, "--samples", "60", "--max-steps", "2", "--checkpoint-every", "2")
    assert first.returncode == 0, first.output[-4000:]
    (checkpoint,) = (tmp_path / "first" / "ckpt").iterdir()
    resumed = run_fit(tmp_path / "resumed", *arguments, "--samples", "60", "--ckpt-path", str(checkpoint))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.result["global_step"] == 5
    assert sorted(sum(resumed.result["seen"], [])) == list(range(24, 60))  # the samples the first run had not used
    steps = [list(range(b, b + 12)) for b in range(0, 60, 12)]
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
    reference = local_reference(IndexedRegression(60), steps, [4, 4], [2, 1], {2, 4, 5}, outer)
    assert max_param_difference(resumed.result, reference) <= TOLERANCE


def test_the_pseudo_gradient_travels_in_half_precision_with_compression(tmp_path):
    """`compression="fp16"`: the weighted deltas go in fp16 (2 bytes per parameter less per rank and step than fp32),
    and one synchronization per step stays close to synchronous SGD."""
    arguments = ["--max-steps", "4"]
    half = run_fit(tmp_path / "half", *local_args("local_sgd", [3, 13], compression="fp16"), *arguments)
    full = run_fit(tmp_path / "full", *local_args("local_sgd", [3, 13]), *arguments)
    assert half.returncode == 0 and full.returncode == 0, (half.output + full.output)[-4000:]
    parameters = sum(torch.tensor(value).numel() for value in full.result["params"].values())

    def sent(run_dir: Path) -> list[float]:
        report = json.loads((run_dir / "hetero" / "report.json").read_text())
        return [step["intra_node_bytes"][0] for step in report["steps"]]

    assert [f - h for f, h in zip(sent(tmp_path / "full"), sent(tmp_path / "half"))] == [2.0 * parameters] * 4
    reference = reference_training(IndexedRegression(64), contiguous_steps(64, 16, 4))
    assert max_param_difference(full.result, reference) <= TOLERANCE
    assert 0 < max_param_difference(half.result, reference) <= 1e-3


# (measured at 4 merges: 2.4e-3 with int8, 3.0e-2 with int4, each once per run; fp16's is under 1e-3)
@pytest.mark.parametrize(("mode", "bits", "tolerance"), [("int8", 8, 5e-3), ("int4", 4, 6e-2)])
def test_the_pseudo_gradient_travels_quantized_with_error_feedback(mode, bits, tolerance, tmp_path):
    """`compression="int8"`/`"int4"`: each rank sends its weighted delta as integers and a scale per block (a quarter or
    an eighth of fp32's bytes, plus the scales, counted on the wire), the parameters are the same on both ranks after
    every merge, and four merges stay near synchronous SGD."""
    arguments = ["--max-steps", "4"]
    quantized = run_fit(
        tmp_path / "q", *local_args("local_sgd", [3, 13], compression=mode), *arguments, "--record-every-step"
    )
    full = run_fit(tmp_path / "full", *local_args("local_sgd", [3, 13]), *arguments)
    assert quantized.returncode == 0 and full.returncode == 0, (quantized.output + full.output)[-4000:]
    parameters = sum(torch.tensor(value).numel() for value in full.result["params"].values())

    def sent(run_dir: Path) -> list[float]:
        report = json.loads((run_dir / "hetero" / "report.json").read_text())
        return [step["intra_node_bytes"][0] for step in report["steps"]]

    # Per step: the same small exchanges (the sample counts...), and the deltas: fp32's 4 bytes a parameter, or the
    # quantized blocks.
    others = {f - 4.0 * parameters for f in sent(tmp_path / "full")}
    assert len(others) == 1 and 0 < others.pop() < 64
    assert [q - wire_bytes(parameters, bits) for q in sent(tmp_path / "q")] == [
        f - 4.0 * parameters for f in sent(tmp_path / "full")
    ]
    records = [json.loads(line) for line in (tmp_path / "q" / "per_step.jsonl").read_text().splitlines()]
    assert [record["spread"] for record in records] == [0.0] * 4  # (the largest difference between the ranks)
    reference = reference_training(IndexedRegression(64), contiguous_steps(64, 16, 4))
    assert 0 < max_param_difference(quantized.result, reference) <= tolerance


@pytest.mark.parametrize(("fragments", "overlap"), [(1, False), (2, False), (2, True)])
def test_a_quantized_resume_carries_each_ranks_error_feedback_and_equals_the_uninterrupted_run(
    fragments, overlap, tmp_path
):
    """int8 DiLoCo, whole or in 2 streaming fragments, with or without overlap: the checkpoint after step 2 (the
    merge in flight applied and every fragment merged first) holds what each rank's rounding left out, and the
    resumed run ends bit-near the uninterrupted one, which saved at step 2 too (without the error feedback, the
    resumed merges would send less and end elsewhere)."""
    arguments = local_args(
        "diloco",
        [4, 4],
        sync_every=2,
        inner_steps=[2, 1],
        compression="int8",
        sync_options={"fragments": fragments, "overlap": overlap},
    )
    whole = run_fit(tmp_path / "whole", *arguments, "--samples", "60", "--checkpoint-every", "2")
    first = run_fit(tmp_path / "first", *arguments, "--samples", "60", "--max-steps", "2", "--checkpoint-every", "2")
    assert whole.returncode == 0 and first.returncode == 0, (whole.output + first.output)[-4000:]
    (checkpoint,) = (tmp_path / "first" / "ckpt").iterdir()
    saved = [torch.load(part, weights_only=True) for part in sorted((checkpoint / "hetero_local_sgd").glob("*.pt"))]
    assert len(saved) == 2 and all(state["error_feedback"].abs().max() > 0 for state in saved)
    resumed = run_fit(
        tmp_path / "resumed", *arguments, "--samples", "60", "--ckpt-path", str(checkpoint), "--checkpoint-every", "2"
    )  # (each checkpoint merges every fragment first: the same ones)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.result["global_step"] == whole.result["global_step"] == 5
    uninterrupted = {
        name.removeprefix("network."): torch.tensor(value) for name, value in whole.result["params"].items()
    }
    assert max_param_difference(resumed.result, uninterrupted) <= 1e-6


def equal_pieces(sizes: list[int], fragments: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The reference's cut, written apart from local/fragments.py: the model's values in ``fragments`` ranges of equal
    size (to a value), as pieces (tensor, first value, end value) of the tensors, and each piece's fragment."""
    total, pieces, owners, offset = sum(sizes), [], [], 0
    edges = [total * fragment // fragments for fragment in range(fragments + 1)]
    for tensor, size in enumerate(sizes):
        for fragment in range(fragments):
            low, high = max(edges[fragment], offset), min(edges[fragment + 1], offset + size)
            if low < high:
                pieces.append((tensor, low - offset, high - offset))
                owners.append(fragment)
        offset += size
    return pieces, owners


def streaming_reference(
    dataset: IndexedRegression,
    steps: list[list[int]],
    micro: list[int],
    inner: list[int],
    sync_every: int,
    fragments: int,
    outer: dict[str, Any],
    lr: float = 0.05,
    momentum: float = 0.9,
    overlap: Optional[int] = None,
    eager: bool = True,
) -> dict[str, torch.Tensor]:
    """Streaming DiLoCo in plain torch: as local_reference, but after step s only the fragments due then merge (each
    a range of the model's values, cut inside a tensor where it ends there, weighted by the samples each rank
    trained on since that fragment's last merge); the others train on. The last step is the epoch's end, where every
    fragment merges.

    ``overlap`` (training steps; None: off): each rank sends what it trained since it last sent and meanwhile takes
    the outer step its own progress would give (on a copy of the outer optimizer; ``eager`` False: trains on from
    where it is); the merge's outer step is applied
    ``overlap`` steps later (the epoch's end waits for it), and each rank's values then become the anchor plus what
    it trained since it sent."""
    start = make_network()
    nets = [copy.deepcopy(start) for _ in micro]
    inner_optimizers = [torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum) for net in nets]
    pieces, owners = equal_pieces([p.numel() for p in start.parameters()], fragments)

    def piece_values(net: torch.nn.Module) -> list[torch.Tensor]:  # (views: written through)
        tensors = [p.detach().view(-1) for p in net.parameters()]
        return [tensors[tensor][begin:end] for tensor, begin, end in pieces]

    anchor = [torch.nn.Parameter(value.clone()) for value in piece_values(start)]
    sent_from = [[value.clone() for value in piece_values(start)] for _ in micro]
    outer_optimizer = torch.optim.SGD(
        anchor, lr=outer["outer_lr"], momentum=outer["outer_momentum"], nesterov=outer["nesterov"]
    )
    samples = [[0] * len(micro) for _ in range(fragments)]  # per fragment, per rank, since its last merge
    pending: Optional[tuple[list[int], list[torch.Tensor]]] = None

    def apply(indices: list[int], averages: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for index, average in zip(indices, averages):
                anchor[index].grad = average.clone()
        outer_optimizer.step()
        outer_optimizer.zero_grad()
        with torch.no_grad():
            for rank, net in enumerate(nets):
                own = piece_values(net)
                for index in indices:
                    trained_since = sent_from[rank][index] - own[index]
                    own[index].copy_(anchor[index] - trained_since)
                    sent_from[rank][index] = anchor[index].detach().clone()

    for number, step in enumerate(steps, start=1):
        for rank, trained in enumerate(inner_training_step(dataset, step, micro, inner, nets, inner_optimizers)):
            for fragment in range(fragments):
                samples[fragment][rank] += trained
        last = number == len(steps)
        if pending is not None and (last or number - pending[2] >= (overlap or 0)):
            apply(*pending[:2])
            pending = None
        due = due_fragments(number, sync_every, fragments, last)
        if not due:
            continue
        indices = [index for fragment in due for index, owner in enumerate(owners) if owner == fragment]
        with torch.no_grad():
            progress = [
                {i: sent_from[rank][i] - piece_values(net)[i] for i in indices} for rank, net in enumerate(nets)
            ]
        averages = []
        for fragment in due:
            total = sum(samples[fragment])
            for index in (index for index, owner in enumerate(owners) if owner == fragment):
                averages.append(sum((n / total) * progress[rank][index] for rank, n in enumerate(samples[fragment])))
            samples[fragment] = [0] * len(micro)
        for rank, net in enumerate(nets):
            own = piece_values(net)
            if (
                overlap is not None and eager and not last
            ):  # the outer step of its own progress (a copy of the outer optimizer's)
                copies = [torch.nn.Parameter(value.detach().clone()) for value in anchor]
                tentative = torch.optim.SGD(
                    copies, lr=outer["outer_lr"], momentum=outer["outer_momentum"], nesterov=outer["nesterov"]
                )
                tentative.load_state_dict(copy.deepcopy(outer_optimizer.state_dict()))
                for index in indices:
                    copies[index].grad = progress[rank][index].detach().clone()
                tentative.step()
                with torch.no_grad():
                    for index in indices:
                        own[index].copy_(copies[index])
            for index in indices:
                sent_from[rank][index] = own[index].detach().clone()
        if overlap is not None and not last:
            pending = (indices, averages, number)
        else:
            apply(indices, averages)
    with torch.no_grad():
        for value, merged in zip(piece_values(start), anchor):
            value.copy_(merged)
    return {name: parameter.detach().clone() for name, parameter in start.named_parameters()}


def test_streaming_fragments_merge_in_turn_as_the_plain_torch_reference_with_a_fragment_on_the_wire_at_a_time(
    tmp_path,
):
    """DiLoCo, inner steps [2, 1], sync_every 2 with `fragments=2`: the first half of the model's values (inside the
    first layer's weight) merges after steps 1 and 3, the other half after steps 2 and 4, all of them at the epoch's
    end (step 5); the parameters are the plain-torch reference's, and each step before the last puts only its
    fragment's deltas on the wire: half the model's."""
    fragments = 2
    arguments = local_args("diloco", [4, 4], sync_every=2, inner_steps=[2, 1], sync_options={"fragments": fragments})
    run = run_fit(tmp_path, *arguments, "--samples", "60")
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["global_step"] == 5
    steps = [list(range(b, b + 12)) for b in range(0, 60, 12)]
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
    reference = streaming_reference(IndexedRegression(60), steps, [4, 4], [2, 1], 2, fragments, outer)
    assert max_param_difference(run.result, reference) <= TOLERANCE
    # (without fragments the same run differs: the check above is not met by merging everything at once)
    assert (
        max_param_difference(
            run.result, local_reference(IndexedRegression(60), steps, [4, 4], [2, 1], {2, 4, 5}, outer)
        )
        > 1e-4
    )
    sizes = [value.numel() for value in reference.values()]
    fragment_values = [sum(sizes) * (f + 1) // fragments - sum(sizes) * f // fragments for f in range(fragments)]
    report = json.loads((tmp_path / "hetero" / "report.json").read_text())
    sent = [step["intra_node_bytes"][0] for step in report["steps"]]
    others = sent[0] - 4 * fragment_values[0]  # (the sample counts and the step's other small exchanges)
    assert sent[:4] == [others + 4 * fragment_values[(s - 1) % fragments] for s in range(1, 5)]
    assert sent[4] == others + 4 * sum(sizes) + 8  # the epoch's end: both fragments (a count each)


@pytest.mark.parametrize(
    ("fragments", "overlap_steps", "eager"), [(1, 2, True), (2, None, True), (1, None, True), (1, 2, False)]
)
def test_an_overlapped_merge_is_applied_one_merge_late_as_the_plain_torch_reference(
    fragments, overlap_steps, eager, tmp_path
):
    """DiLoCo with `overlap=True`, inner steps [2, 1], sync_every 2 (merges sent after steps 2 and 4, or one fragment
    after each of steps 1-4): each merge's outer step is applied one step after it was sent (the default; with 2
    fragments that is the next merge) or, with `overlap_steps=2`, at the next merge, and the epoch's end waits for
    it; meanwhile each rank trains on from its own progress's outer step (the default) or, with `eager=False`, from
    its own parameters. The parameters are the stale-by-one reference's, and not the reference's without overlap
    nor the other stand-in's. The report names each rank's wait on the link."""
    options = {"fragments": fragments, "overlap": True}
    if overlap_steps is not None:
        options["overlap_steps"] = overlap_steps
    if not eager:
        options["eager"] = False
    arguments = local_args("diloco", [4, 4], sync_every=2, inner_steps=[2, 1], sync_options=options)
    run = run_fit(tmp_path, *arguments, "--samples", "60")
    assert run.returncode == 0, run.output[-4000:]
    assert sorted(sum(run.result["seen"], [])) == list(range(60))  # every sample once
    steps = [list(range(b, b + 12)) for b in range(0, 60, 12)]
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
    dataset = IndexedRegression(60)
    applied_after = overlap_steps or 1
    reference = streaming_reference(
        dataset, steps, [4, 4], [2, 1], 2, fragments, outer, overlap=applied_after, eager=eager
    )
    assert max_param_difference(run.result, reference) <= TOLERANCE
    other_stand_in = streaming_reference(
        dataset, steps, [4, 4], [2, 1], 2, fragments, outer, overlap=applied_after, eager=not eager
    )
    assert max_param_difference(run.result, other_stand_in) > 1e-4
    waited = streaming_reference(dataset, steps, [4, 4], [2, 1], 2, fragments, outer)
    assert max_param_difference(run.result, waited) > 1e-4
    stand_in = "the outer step of their own progress" if eager else "their own parameters"
    assert f"each merge is sent in the background while the ranks train on from {stand_in}" in run.output
    if fragments == 1:  # (one step or two later: not the same run)
        other = 1 if applied_after == 2 else 2
        applied_otherwise = streaming_reference(
            dataset, steps, [4, 4], [2, 1], 2, fragments, outer, overlap=other, eager=eager
        )
        assert max_param_difference(run.result, applied_otherwise) > 1e-4
    report = json.loads((tmp_path / "hetero" / "report.json").read_text())
    assert all(len(step["link_wait_seconds"]) == 2 for step in report["steps"])
    assert len(report["summary"]["link_wait_seconds_per_step"]) == 2
    assert "waiting on the link in merges per step, per rank" in run.output


def test_an_inner_micro_batch_over_the_emulated_memory_is_refused_on_every_rank(tmp_path):
    run = run_fit(
        tmp_path,
        *local_args("diloco", [8, 8], inner_steps=[2, 1]),
        timeout=120,
        env={"LIGHTNING_HETERO_EMULATE_MEMORY": "4,-"},
    )
    assert run.returncode != 0
    message = "Rank 0's micro-batch of 8 samples (16 in 2 micro-steps) does not fit in its memory"
    assert run.output.count(message) >= 2, run.output[-3000:]
    assert "micro-batches of at most 4 samples (`batch_sizes=[...]`" in run.output
