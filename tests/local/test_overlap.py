"""Overlapped merges (``sync_options={"overlap": True}``): the exchange of a merge runs while the ranks train on,
and its outer step is applied one merge late, against a plain-torch reference of that stale-by-one algorithm.

Two ranks are threads of this process here; their collectives meet at a barrier (see tests/comm/test_quantize.py).
The strategy's path, on two processes, is in test_local_sgd_multiprocess.py.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "comm"))

from test_quantize import SumOfTwo, ThreadGather, on_two_threads  # noqa: E402

from lightning_hetero.local.fragments import due_fragments  # noqa: E402
from lightning_hetero.local.merges import LocalTraining  # noqa: E402

OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
SAMPLES = [3, 1]  # each rank's samples per training step
SHAPES = [(40,), (6, 5), (7,)]


def start_values() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def targets() -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in SAMPLES]


def train_step(values: list[torch.Tensor], rank: int, step: int) -> None:
    """A rank's training step: a pull towards its own target, from where it is, and not linear in it (with a linear
    step the eager stand-ins average out to the merged anchor, and the overlap would end where the run without it
    does). Value by value, so the reference below takes it on the model's values flattened."""
    for value, target in zip(values, targets()[rank]):
        value.sub_((0.1 + 0.01 * step) * torch.tanh(2 * (value - target)))


def flat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([value.reshape(-1) for value in values])


def stale_by_one_reference(
    steps: int, sync_every: int, fragments: int, overlap: Optional[int], eager: bool = True
) -> list[torch.Tensor]:
    """Every rank's values (the model's, flattened) after ``steps`` training steps (the last ends the epoch), DiLoCo
    in plain torch.

    The values are cut into ``fragments`` ranges of equal size (to a value), inside a tensor where a range ends
    there. At a merge of fragment set D every rank sends the progress of D's values since it last sent them, weighted
    by its samples since; with overlap (None: off) each rank meanwhile takes the outer step its own progress would
    give (on a copy of the outer optimizer; ``eager`` False: it trains on from where it is), the merge's real outer
    step is applied ``overlap`` training steps later (before anything else is sent), and each rank's values then
    become the new anchor plus what the rank trained since it sent; the epoch's end waits for both."""
    start = flat(start_values())
    edges = [start.numel() * fragment // fragments for fragment in range(fragments + 1)]
    ranges = list(zip(edges, edges[1:]))
    anchor = [torch.nn.Parameter(start[begin:end].clone()) for begin, end in ranges]  # one outer tensor a fragment
    outer = torch.optim.SGD(anchor, lr=OUTER["outer_lr"], momentum=OUTER["outer_momentum"], nesterov=True)
    params = [start.clone() for _ in SAMPLES]
    sent_from = [start.clone() for _ in SAMPLES]
    samples = [[0] * len(SAMPLES) for _ in range(fragments)]
    pending = None

    def apply(merge):
        due, averages, _ = merge
        with torch.no_grad():
            for fragment, average in zip(due, averages):
                anchor[fragment].grad = average
            outer.step()
            outer.zero_grad(set_to_none=True)
            for rank in range(len(SAMPLES)):
                for fragment in due:
                    begin, end = ranges[fragment]
                    trained_since = sent_from[rank][begin:end] - params[rank][begin:end]
                    params[rank][begin:end] = anchor[fragment].detach() - trained_since
                    sent_from[rank][begin:end] = anchor[fragment].detach()

    for step in range(1, steps + 1):
        for rank in range(len(SAMPLES)):
            values = list(params[rank].split([value.numel() for value in start_values()]))
            train_step([value.view(shape) for value, shape in zip(values, SHAPES)], rank, step)
            for fragment in range(fragments):
                samples[fragment][rank] += SAMPLES[rank]
        last = step == steps
        if pending is not None and (step - pending[2] >= overlap or last):
            apply(pending)
            pending = None
        due = sorted(due_fragments(step, sync_every, fragments, last))
        if not due:
            continue
        progress = [{f: sent_from[r][slice(*ranges[f])] - params[r][slice(*ranges[f])] for f in due} for r in (0, 1)]
        averages = []
        for fragment in due:
            total = sum(samples[fragment])
            averages.append(sum((n / total) * progress[r][fragment] for r, n in enumerate(samples[fragment])))
            samples[fragment] = [0] * len(SAMPLES)
        for rank in range(len(SAMPLES)):
            stand_in = eager_step(anchor, outer, progress[rank]) if overlap is not None and eager and not last else None
            for fragment in due:
                begin, end = ranges[fragment]
                if stand_in is not None:  # (overlap: the outer step of its own progress, until the average arrives)
                    params[rank][begin:end] = stand_in[fragment]
                sent_from[rank][begin:end] = params[rank][begin:end]
        pending = (due, averages, step)
        if last or overlap is None:
            apply(pending)
            pending = None
    return params


def eager_step(anchor, outer, progress):
    """The anchor after one step of a copy of ``outer`` with ``progress`` (tensor index -> value) as the gradient."""
    copies = [torch.nn.Parameter(value.detach().clone()) for value in anchor]
    tentative = torch.optim.SGD(copies, lr=OUTER["outer_lr"], momentum=OUTER["outer_momentum"], nesterov=True)
    tentative.load_state_dict(copy.deepcopy(outer.state_dict()))  # (load_state_dict shares tensors)
    for index, value in progress.items():
        copies[index].grad = value.clone()
    tentative.step()
    return [value.detach() for value in copies]


def run_two_ranks(
    steps: int, sync_every: int, fragments: int, overlap: Optional[int], eager: bool = True
) -> list[list[torch.Tensor]]:
    gather, sum_of_two = ThreadGather(2), SumOfTwo()
    parameters = [[torch.nn.Parameter(value.clone()) for value in start_values()] for _ in SAMPLES]
    started_in_background = [0, 0]

    def run(rank: int) -> None:
        training = LocalTraining("diloco", sync_every, OUTER, None, fragments=fragments, overlap=overlap, eager=eager)
        training.attach(parameters[rank], None)
        all_reduce = sum_of_two(rank)

        def start(tensor, quantized):
            started_in_background[rank] += 1
            all_reduce(tensor)  # (summed at once here; the merge applies it later all the same)
            return lambda: None

        for step in range(1, steps + 1):
            with torch.no_grad():
                train_step([p.data for p in parameters[rank]], rank, step)
            training.step_done(SAMPLES[rank], step == steps, all_reduce, gather.for_rank(rank), start)
        assert not training.merge_pending

    on_two_threads(run)
    merges_inside_the_epoch = sum(1 for step in range(1, steps) if due_fragments(step, sync_every, fragments, False))
    assert started_in_background == [merges_inside_the_epoch if overlap is not None else 0] * 2
    return [[p.detach() for p in rank_parameters] for rank_parameters in parameters]


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize(("fragments", "overlap"), [(1, 3), (1, 1), (1, 2), (3, 1)])
def test_an_overlapped_merge_is_the_stale_by_one_reference_and_leaves_the_ranks_equal_at_the_epochs_end(
    fragments, overlap, eager
):
    """DiLoCo, sync_every 3, 10 steps (merges inside the epoch after steps 3, 6, 9; or one fragment every step with
    3 fragments), each applied ``overlap`` steps after it was sent (3 or, with 3 fragments, 1: at the next merge),
    each rank meanwhile training on from the eager step or (``eager`` False) from its own parameters: both ranks end
    with the same parameters, the reference's within 1e-5; they differ from the other stand-in's and from the run
    without overlap (whose own reference it also matches), so the late outer step is what was tested."""
    overlapped = run_two_ranks(10, 3, fragments, overlap, eager)
    for a, b in zip(*overlapped):
        assert torch.equal(a, b)
    reference = stale_by_one_reference(10, 3, fragments, overlap, eager)
    assert (flat(overlapped[0]) - reference[0]).abs().max().item() <= 1e-5
    other_stand_in = stale_by_one_reference(10, 3, fragments, overlap, not eager)
    assert (flat(overlapped[0]) - other_stand_in[0]).abs().max().item() > 1e-4
    if overlap < 3 // fragments:  # (applied before the next merge: not the same run as applying it at the next one)
        at_next_merge = stale_by_one_reference(10, 3, fragments, 3 // fragments, eager)
        assert (flat(overlapped[0]) - at_next_merge[0]).abs().max().item() > 1e-4
    waited = run_two_ranks(10, 3, fragments, None)
    without = stale_by_one_reference(10, 3, fragments, None)
    assert (flat(waited[0]) - without[0]).abs().max().item() <= 1e-5
    assert (flat(overlapped[0]) - flat(waited[0])).abs().max().item() > 1e-3


def test_between_merges_each_rank_holds_the_common_anchor_plus_its_own_progress():
    """Overlap, one fragment, sync_every 2, 4 steps: after step 4's merge (merge 1 applied, merge 2 sent) the ranks'
    anchors are the same, bit for bit, and each rank's parameters are the outer step (on a copy of the outer
    optimizer) that what it trained in steps 3 and 4 would give, its stand-in for merge 2's average; so the ranks'
    parameters differ until the next merge."""
    gather, sum_of_two = ThreadGather(2), SumOfTwo()
    parameters = [[torch.nn.Parameter(value.clone()) for value in start_values()] for _ in SAMPLES]
    trainings = [LocalTraining("diloco", 2, OUTER, None, overlap=2) for _ in SAMPLES]
    seen: dict[int, dict[str, list]] = {0: {}, 1: {}}

    def run(rank: int) -> None:
        training = trainings[rank]
        training.attach(parameters[rank], None)
        all_reduce = sum_of_two(rank)

        def start(tensor, quantized):
            all_reduce(tensor)
            return lambda: None

        for step in range(1, 5):
            with torch.no_grad():
                train_step([p.data for p in parameters[rank]], rank, step)
            if step == 4:
                seen[rank]["before"] = [p.detach().clone() for p in parameters[rank]]
            training.step_done(SAMPLES[rank], False, all_reduce, gather.for_rank(rank), start)
            if step == 2:
                seen[rank]["sent"] = [p.detach().clone() for p in parameters[rank]]
        assert training.merge_pending and training.steps_since_sync == 0 and training.synchronizations == 1
        seen[rank]["after"] = [p.detach().clone() for p in parameters[rank]]

    on_two_threads(run)
    for a, b in zip(trainings[0]._anchor, trainings[1]._anchor):
        assert torch.equal(a, b)
    for rank in range(2):
        trained = [sent - before for sent, before in zip(seen[rank]["sent"], seen[rank]["before"])]
        training = trainings[rank]
        eager = eager_step(training._outer_parameters, training._outer, dict(enumerate(trained)))
        for after, expected in zip(seen[rank]["after"], eager):
            assert torch.allclose(after, expected, atol=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(seen[0]["after"], seen[1]["after"])) > 1e-3


def test_a_flush_waits_for_the_merge_in_flight_then_merges_what_trained_since():
    """One rank: a merge sent in the background at step 2 and one more step trained; `synchronize` (a checkpoint's
    or a validation's) applies the one in flight and merges step 3's progress: nothing is pending after it, and the
    parameters are the anchor."""
    parameter = torch.nn.Parameter(torch.zeros(5))
    training = LocalTraining("local_sgd", 2, None, None, overlap=2)
    training.attach([parameter], None)
    waited = []

    def start(tensor, quantized):
        return lambda: waited.append(tensor.clone())

    for _ in range(3):
        with torch.no_grad():
            parameter.sub_(0.1)
        training.step_done(1, False, lambda tensor: None, None, start)
    assert training.merge_pending and training.steps_since_sync == 1 and not waited
    training.synchronize(lambda tensor: None)
    assert len(waited) == 1 and not training.merge_pending and training.synchronizations == 2
    # one rank: local SGD's average is its own progress, so nothing is lost: three steps of -0.1
    assert torch.allclose(parameter.detach(), torch.full((5,), -0.3))
    with pytest.raises(AssertionError, match="no merge in flight"):
        training._in_flight = training._send([0], lambda tensor: None, start)
        training.state()


def test_outer_momentum_written_for_other_fragments_is_refused_at_load_and_the_same_fragments_resume(tmp_path):
    """Written with 2 fragments (the cut at value 38 is inside the first tensor: 4 pieces), resumed with 1 (3
    tensors): torch's SGD checks only the count of its parameters, so momentum of other shapes is refused here,
    naming `fragments`; resumed with 2 fragments, the outer momentum is the one saved."""

    def attached(fragments: int) -> LocalTraining:
        training = LocalTraining("diloco", 2, OUTER, None, fragments=fragments)
        training.attach([torch.nn.Parameter(value.clone()) for value in start_values()], None)
        return training

    saved = attached(2)
    with torch.no_grad():
        for parameter in saved._parameters:
            parameter.sub_(0.1)
    saved.samples_since_sync = saved.steps_since_sync = 1
    saved.synchronize(lambda tensor: None)
    saved.save(tmp_path, 0)
    with pytest.raises(ValueError, match=r"outer momentum for 4 parameter pieces, not this fit's 3.*fragments=1"):
        attached(1).load(tmp_path, 0)
    resumed = attached(2)
    resumed.load(tmp_path, 0)
    momentum = [resumed._outer.state[p]["momentum_buffer"] for p in resumed._outer_parameters]
    assert [tuple(m.shape) for m in momentum] == [(38,), (2,), (6, 5), (7,)]
    expected = [saved._outer.state[p]["momentum_buffer"] for p in saved._outer_parameters]
    assert all(torch.equal(a, b) for a, b in zip(momentum, expected))


def test_outer_momentum_of_as_many_pieces_of_other_shapes_is_refused(tmp_path):
    """A model of one 10-value tensor in 2 fragments (pieces of 5 and 5) and one of tensors of 4 and 6 in 1: as many
    pieces, other shapes; torch's SGD would load the momentum, and the next outer step would fail or broadcast."""
    saved = LocalTraining("diloco", 2, OUTER, None, fragments=2)
    saved.attach([torch.nn.Parameter(torch.zeros(10))], None)
    with torch.no_grad():
        saved._parameters[0].sub_(0.1)
    saved.samples_since_sync = saved.steps_since_sync = 1
    saved.synchronize(lambda tensor: None)
    saved.save(tmp_path, 0)
    other = LocalTraining("diloco", 2, OUTER, None)
    other.attach([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(6))], None)
    with pytest.raises(ValueError, match=r"for 2 parameter pieces, not this fit's 2 \(or of other shapes\)"):
        other.load(tmp_path, 0)


def test_a_parameter_not_contiguous_in_memory_stays_whole_and_merges_as_with_one_fragment():
    """A transposed weight cannot be cut through a flat view: with 2 fragments over [it (8x5, transposed: 40 values),
    30 values] the cut at value 35, inside it, moves to its end; both fragments merge at the epoch's end to what one
    fragment merges to."""

    def merged(fragments: int) -> list[torch.Tensor]:
        parameters = [torch.nn.Parameter(torch.zeros(5, 8).t()), torch.nn.Parameter(torch.zeros(30))]
        training = LocalTraining("local_sgd", 4, None, None, fragments=fragments)
        training.attach(parameters, None)
        assert not parameters[0].is_contiguous()
        assert training._pieces == [(0, 0, 40), (1, 0, 30)]  # (one fragment: the tensors; two: the cut at 40)
        assert training._bounds == ([(0, 2)] if fragments == 1 else [(0, 1), (1, 2)])
        with torch.no_grad():
            parameters[0].sub_(torch.arange(40.0).view(8, 5))
            parameters[1].sub_(0.5)
        training.step_done(1, True, lambda tensor: None, None)  # (the epoch's last step: every fragment merges)
        return [p.detach().clone() for p in parameters]

    for whole, cut in zip(merged(1), merged(2)):
        assert torch.equal(whole, cut)
    assert torch.equal(merged(2)[0], -torch.arange(40.0).view(8, 5))
