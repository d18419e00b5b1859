"""The pipeline's pieces that need no process (pipeline/stage.py, pipeline/blocks.py, comm/point_to_point.py)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_hetero.comm.point_to_point import empty_from, header_of
from lightning_hetero.pipeline.blocks import check_chain_order, reads_another_stage_could_hold
from lightning_hetero.pipeline.chain import (
    ElsewhereBlock,
    HandOff,
    StageOfChain,
    check_chain_shape,
    find_chain,
)
from lightning_hetero.pipeline.options import PipelineChoice
from lightning_hetero.pipeline.placement import in_flight
from lightning_hetero.pipeline.stage import PipelineLayout, interleaved_actions, schedule_actions


class Model(LightningModule):
    def __init__(self, blocks: int = 5, container: str = "sequential", use=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, 6)
        made = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(blocks)]
        self.container = container
        if container == "sequential":
            self.net = nn.Sequential(*made)
        elif container == "list":
            self.net = nn.ModuleList(made)
        else:
            self.net = nn.ModuleDict({f"layer{i}": b for i, b in enumerate(made)})
        self.head = nn.Linear(6, 1)
        self.use = use  # the order in which forward applies the blocks (None: the chain's)

    def forward(self, x):
        x = self.embed(x)
        if self.container == "sequential" and self.use is None:
            x = self.net(x)
        else:
            blocks = list(self.net.values()) if isinstance(self.net, nn.ModuleDict) else list(self.net)
            for index in self.use if self.use is not None else range(len(blocks)):
                x = blocks[index](x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


BATCH = (torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), torch.randn(4, 1))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 7])
def test_every_schedule_runs_each_pass_once_and_never_deadlocks(schedule, stages, micro_batches):
    plans = [schedule_actions(schedule, s, stages, micro_batches) for s in range(stages)]
    for actions in plans:
        assert sorted(actions) == sorted(
            [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]
        )
        for m in range(micro_batches):
            assert actions.index(("F", m)) < actions.index(("B", m))
    # Run them against each other (one chunk each): a forward needs the previous stage's forward, a backward the next
    # stage's backward (receives block, sends never do). Every stage must finish.
    chunked = [[(kind, m, 0) for kind, m in actions] for actions in plans]
    assert run_against_each_other(chunked, chunks=1) == [len(p) for p in plans]
    if schedule == "1f1b":  # at most stages - s micro-batches held at once
        for s, actions in enumerate(plans):
            held = peak = 0
            for kind, _ in actions:
                held += 1 if kind == "F" else -1
                peak = max(peak, held)
            assert peak <= min(stages - s, micro_batches)


def run_against_each_other(plans: list[list[tuple[str, int, int]]], chunks: int) -> list[int]:
    """Each stage's passes in its order, a receive blocking until the sender's pass is done (sends never block, and
    a message may be taken out of order: the link keeps those that came first). Returns how far each stage got."""
    stages = len(plans)
    done = [set() for _ in range(stages)]
    position = [0] * stages
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            if position[s] == len(plans[s]):
                continue
            kind, m, v = plans[s][position[s]]
            if kind == "F":  # the previous chunk's forward: this chain's chunk v*S + s - 1
                ready = ("F", m, v) in done[s - 1] if s > 0 else v == 0 or ("F", m, v - 1) in done[stages - 1]
            elif s < stages - 1:
                ready = ("B", m, v) in done[s + 1]
            else:  # the last stage: the next chunk's backward, or its own forward's loss
                ready = ("B", m, v + 1) in done[0] if v < chunks - 1 else ("F", m, v) in done[s]
            if ready:
                done[s].add((kind, m, v))
                position[s] += 1
                progress = True
    return position


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("chunks", [2, 3, 4])
@pytest.mark.parametrize("micro_batches", list(range(1, 13)))
def test_the_interleaved_schedule_runs_each_chunk_s_passes_once_and_never_deadlocks(stages, chunks, micro_batches):
    plans = [interleaved_actions(s, stages, micro_batches, chunks) for s in range(stages)]
    every = [(k, m, v) for k in "FB" for m in range(micro_batches) for v in range(chunks)]
    for actions in plans:
        assert sorted(actions) == sorted(every)
        for m, v in itertools.product(range(micro_batches), range(chunks)):
            assert actions.index(("F", m, v)) < actions.index(("B", m, v))
    assert run_against_each_other(plans, chunks) == [len(p) for p in plans]
    if micro_batches % stages == 0:  # Megatron-LM's order: warm-up forwards, then one of each in turn
        for s, actions in enumerate(plans):
            warm_up = min(micro_batches * chunks, 2 * (stages - s - 1) + (chunks - 1) * stages)
            assert [kind for kind, _, _ in actions[:warm_up]] == ["F"] * warm_up
            steady = actions[warm_up : 2 * micro_batches * chunks - warm_up]
            assert [kind for kind, _, _ in steady] == ["F", "B"] * (len(steady) // 2)
        # A stage holds at most its warm-up and one more chunk pass at once: what the placement's memory counts.
        for s, actions in enumerate(plans):
            held = [sum(1 if kind == "F" else -1 for kind, _, _ in actions[: i + 1]) for i in range(len(actions))]
            assert max(held) == min(micro_batches * chunks, 2 * (stages - s - 1) + (chunks - 1) * stages + 1)
            assert in_flight("interleaved", s, stages, micro_batches, chunks) == -(-max(held) // chunks)
    else:  # (that order can deadlock here, e.g. 4 stages, 3 chunks, 5 micro-batches: GPipe's over the chunks)
        for actions in plans:
            kinds = [kind for kind, _, _ in actions]
            assert kinds == ["F"] * (micro_batches * chunks) + ["B"] * (micro_batches * chunks)


def test_the_interleaved_order_is_megatron_s_for_two_stages_of_two_chunks():
    """Stage 0 of 2, 2 chunks, 4 micro-batches: micro-batches 0-1 through chunk 0, then chunk 1, then 2-3..."""
    assert interleaved_actions(0, 2, 4, 2) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 0, 1),
        ("F", 1, 1),  # warm-up: 2 (2 - 0 - 1) + (2 - 1) 2 = 4
        ("F", 2, 0),
        ("B", 0, 1),
        ("F", 3, 0),
        ("B", 1, 1),
        ("F", 2, 1),
        ("B", 0, 0),
        ("F", 3, 1),
        ("B", 1, 0),
        ("B", 2, 1),
        ("B", 3, 1),
        ("B", 2, 0),
        ("B", 3, 0),
    ]  # fmt: skip (four passes a line: the warm-up, the steady state in pairs and the cool-down read as the schedule)


def test_the_layout_places_pipelines_side_by_side():
    layout = PipelineLayout(stages=2, replicas=2, order=(1, 0))
    assert [layout.rank_of(p, s) for p in range(2) for s in range(2)] == [1, 0, 3, 2]
    assert [layout.stage_of(r) for r in range(4)] == [1, 0, 1, 0]
    assert [layout.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.stage_ranks(0) == [1, 3]


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("layers", r"`blocks` 'layers': Model has no attribute 'layers' \(its modules: \['embed', 'net', 'head'\]\)"),
        ("net.inner", r"`blocks` 'net.inner': net has no attribute 'inner'"),
        ("head", r"`blocks` 'head' is a Linear, not a chain the strategy can split"),
    ],
)
def test_a_chain_that_is_not_there_is_named(path, match):
    with pytest.raises(ValueError, match=match):
        find_chain(Model(), path)


def test_stages_and_boundaries_are_checked_against_the_chain():
    with pytest.raises(ValueError, match="`stages` 6 is more than the 5 blocks of `net`"):
        check_chain_shape(Model(), PipelineChoice(6, "net"))
    with pytest.raises(ValueError, match=r"`boundaries` \[5\] must increase strictly, each between 1 and 4"):
        check_chain_shape(Model(), PipelineChoice(2, "net", (5,)))
    assert check_chain_shape(Model(), PipelineChoice(2, "net", (3,)))[1] == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize(
    ("use", "match"),
    [
        ([0, 1, 1, 2, 3, 4], "runs block '1' more than once"),
        ([0, 2, 1, 3, 4], r"runs them out of order \(\['0', '2', '1', '3', '4'\]\)"),
        ([0, 1, 2], r"runs only \['0', '1', '2'\]"),
    ],
)
def test_a_chain_that_cannot_be_split_is_refused_naming_the_block(use, match):
    model = Model(container="list", use=use)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        check_chain_order(model, list(model.net), [str(i) for i in range(5)], "net", BATCH, torch.device("cpu"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_chain_applied_in_order_passes_the_check():
    model = Model(container="dict")
    check_chain_order(model, list(model.net.values()), list(model.net), "net", BATCH, torch.device("cpu"))


class SkipModel(Model):
    """The blocks in a ModuleList, applied in order, with one of the ways a later block can read an earlier one's
    tensor (``skip``), or with what every stage may read (what runs before the chain, the previous block's output)."""

    def __init__(self, skip: str) -> None:
        super().__init__(blocks=5, container="list")
        self.skip = skip

    def forward(self, x):
        x = self.embed(x)
        before_chain = x * 2  # (every stage runs what precedes the chain: any block may read it)
        kept = None
        for index, block in enumerate(self.net):
            if self.skip == "residual" and index == 3:
                x = block(x + kept)  # (before block 3) block 1's output, which a later stage may not hold
            elif self.skip == "attribute" and index == 4:
                x = block(x) + self.net[1].hidden  # a tensor made after block 1, kept on the module
            elif self.skip == "before the chain":
                x = block(x + before_chain)
            else:
                x = block(x)
            if index == 1:
                kept = x
                self.net[1].hidden = x * 1 if self.skip == "attribute" else None
        if self.skip == "head":
            x = x + kept  # the head reads block 1's output
        return self.head(x)


@pytest.mark.parametrize(
    ("skip", "match"),
    [
        ("residual", "the code between block '2' and the next reads a tensor made after block '1'"),
        ("attribute", "the code after the chain \\(the last stage's\\) reads a tensor made after block '1'"),
        ("head", "the code after the chain \\(the last stage's\\) reads a tensor made after block '1'"),
    ],
)
def test_a_skip_connection_between_blocks_is_refused_naming_them(skip, match):
    """A tensor an earlier block made, read by a later block (or the head) other than through the previous block's
    output: on another stage it would not be there. Found in the one run of the whole model before the split."""
    model = SkipModel(skip)
    with pytest.raises(ValueError, match=f"a skip connection in the chain `net`: {match}"):
        check_chain_order(model, list(model.net), [str(i) for i in range(5)], "net", BATCH, torch.device("cpu"))


class Remembering(nn.Module):
    """A block that keeps a tensor it made in a shared store, or reads one another block kept there, inside its own
    forward (as a cache shared by layers would)."""

    def __init__(self, inner: nn.Module, store: dict, keep: str = "", read: str = "") -> None:
        super().__init__()
        self.inner, self.store, self.keep, self.read = inner, store, keep, read

    def forward(self, x):
        hidden = self.inner(x)
        if self.read:
            hidden = hidden + self.store[self.read]
        if self.keep:
            self.store[self.keep] = hidden * 0.5
        return hidden


def test_a_tensor_one_block_makes_and_a_later_block_reads_inside_itself_is_refused():
    model = Model(container="list")
    store: dict = {}
    model.net[1] = Remembering(model.net[1], store, keep="h1")
    model.net[3] = Remembering(model.net[3], store, read="h1")
    with pytest.raises(ValueError, match="block '3' reads a tensor made inside block '1'"):
        check_chain_order(model, list(model.net), [str(i) for i in range(5)], "net", BATCH, torch.device("cpu"))
    # Kept and read inside the same block (a block's own cache): nothing crosses a stage.
    model = Model(container="list")
    model.net[2] = Remembering(Remembering(model.net[2], store, keep="h2"), store, read="h2")
    check_chain_order(model, list(model.net), [str(i) for i in range(5)], "net", BATCH, torch.device("cpu"))


@pytest.mark.parametrize("skip", ["none", "before the chain"])
def test_what_every_stage_holds_is_no_skip_connection(skip):
    model = SkipModel(skip)
    check_chain_order(model, list(model.net), [str(i) for i in range(5)], "net", BATCH, torch.device("cpu"))


@pytest.mark.parametrize(
    ("producer", "reader", "crosses"),
    [
        (("in", 2), ("in", 2), False),
        (("after", 1), ("in", 2), False),
        (("after", 2), ("after", 2), False),
        (("in", 1), ("in", 2), True),  # an inner tensor of the previous block: only its output is handed on
        (("after", 0), ("in", 2), True),
        (("in", 2), ("after", 2), True),
        (("after", 1), ("after", 2), True),
    ],
)
def test_which_reads_a_stage_boundary_could_cut(producer, reader, crosses):
    assert reads_another_stage_could_hold(producer, reader) is crosses


@pytest.mark.parametrize("container", ["sequential", "list", "dict"])
@pytest.mark.parametrize("boundaries", [(2,), (1, 4), (1, 2, 3, 4)])
def test_stages_in_one_process_make_one_process_gradients(container, boundaries):
    """The hooks without processes: each stage a copy of the model, the activations and gradients handed over by
    hand. The outside modules' gradients summed over the stages and each block's from its stage are the whole
    model's, and each stage's state_dict names its blocks as the model does."""
    reference = Model(container=container)
    reference.training_step(BATCH, 0).backward()
    stages = len(boundaries) + 1
    edges = (0, *boundaries, 5)
    copies = [Model(container=container) for _ in range(stages)]
    installed = []
    for s, model in enumerate(copies):
        chain, names = find_chain(model, "net")
        stage = StageOfChain(chain, names, range(edges[s], edges[s + 1]), s, stages, "net")
        stage.install()
        installed.append(stage)
    outputs, inputs = [], []
    for s, model in enumerate(copies):
        installed[s].pass_starts()
        if s > 0:
            received = outputs[-1].detach().requires_grad_()
            inputs.append(received)
            installed[s].incoming = received
        if s < stages - 1:
            with pytest.raises(HandOff) as hand_off:
                model.training_step(BATCH, 0)
            outputs.append(hand_off.value.output)
        else:
            loss = model.training_step(BATCH, 0)
    loss.backward()
    for s in range(stages - 2, -1, -1):
        outputs[s].backward(inputs[s].grad)
    names_by_stage = [set(model.state_dict()) for model in copies]
    for name, parameter in reference.named_parameters():
        holders = [s for s in range(stages) if name in names_by_stage[s]]
        if name.startswith("net."):
            assert len(holders) == 1  # each block on one stage, under its own name
            grad = dict(copies[holders[0]].named_parameters())[name].grad
        else:
            assert holders == list(range(stages))  # the outside modules on every stage
            grads = [dict(c.named_parameters())[name].grad for c in copies]
            grad = sum(g for g in grads if g is not None)
        torch.testing.assert_close(grad, parameter.grad, rtol=0, atol=1e-6)
    assert any(isinstance(m, ElsewhereBlock) for m in copies[0].modules())


def test_a_stage_output_that_is_not_a_tensor_is_refused():
    class TupleBlock(nn.Module):
        def forward(self, x):
            return (x, x)

    model = Model()
    model.net[1] = TupleBlock()
    chain, names = find_chain(model, "net")
    StageOfChain(chain, names, range(0, 2), 0, 2, "net").install()
    with pytest.raises(ValueError, match="block '1' of `net` returned a tuple; a stage boundary passes one tensor"):
        model.training_step(BATCH, 0)


@pytest.mark.parametrize("tensor", [torch.randn(3, 4, 5), torch.ones(2, dtype=torch.bfloat16), torch.zeros(())])
def test_a_header_describes_what_arrives(tensor):
    arrived = empty_from(header_of(tensor), torch.device("cpu"))
    assert arrived.shape == tensor.shape and arrived.dtype == tensor.dtype


def test_a_tensor_that_cannot_travel_is_named():
    with pytest.raises(ValueError, match="dtype torch.complex64"):
        header_of(torch.zeros(2, dtype=torch.complex64))


def test_each_stage_of_a_split_model_has_the_whole_model_s_signature():
    """The setup survey compares the ranks' models: after a pipeline fit each rank holds its own stage only, and a
    later trainer call (an evaluation on the fit's Trainer) still sees one model on every rank."""
    from lightning_hetero.configure.model_agreement import model_signature

    whole = model_signature(Model())
    for owned in (range(0, 2), range(2, 5)):
        model = Model()
        chain, names = find_chain(model, "net")
        StageOfChain(chain, names, owned, 0 if owned.start == 0 else 1, 2, "net").install()
        assert model_signature(model) == whole
        StageOfChain(chain, names, owned, 0 if owned.start == 0 else 1, 2, "net").install()  # (installed again)
        assert model_signature(model) == whole
    other = Model()
    other.net[3] = nn.Linear(4, 5)
    assert model_signature(other) != whole


def test_a_model_split_by_an_earlier_fit_is_refused_for_another():
    model = Model()
    chain, names = find_chain(model, "net")
    StageOfChain(chain, names, range(0, 2), 0, 2, "net").install()
    with pytest.raises(
        ValueError, match=r"was split by an earlier pipeline fit on this rank \(blocks \['2', '3', '4'\]"
    ):
        check_chain_shape(model, PipelineChoice(2, "net"))
    # An evaluation on the strategy that split it runs on that split (each rank's own stage), so it is let through.
    assert check_chain_shape(model, PipelineChoice(2, "net"), stage_kept=True)[1] == ["0", "1", "2", "3", "4"]
