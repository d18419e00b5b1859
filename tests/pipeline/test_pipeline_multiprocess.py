"""Pipeline parallelism against one process: the same global batches, the same update (pipeline/stage.py)."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from conftest import REPO, devices_in, run_bounded, run_warm_job, sigterm_mid_training
from lightning.pytorch import seed_everything

sys.path.insert(0, str(REPO / "tests" / "workers"))

from pipeline_fit import WIDTH, ChainModel, dataset  # noqa: E402

from lightning_hetero.recover.stopping import EXIT_CODE_INTERRUPTED  # noqa: E402

WORKER = REPO / "tests" / "workers" / "pipeline_fit.py"


def one_process(
    optimizer: str,
    steps: int,
    global_batch: int,
    width: int = WIDTH,
    clip: Optional[float] = None,
    accumulate: int = 1,
    skipped: tuple[int, ...] = (),
) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole model, the same global batches in the loader's order; ``accumulate``
    batches per step, each batch's mean loss divided by it (as Lightning's closure does), an epoch's last step taking
    what is left (as Lightning steps at an epoch's last batch), and the whole model's gradient clipped to the norm
    ``clip`` before each step; the steps in ``skipped`` change nothing (a non-finite gradient's step)."""
    seed_everything(1, verbose=False)
    model = ChainModel(optimizer, width=width)
    (opt,) = [model.configure_optimizers()]
    x, y = dataset().tensors
    epoch = [(start, min(start + global_batch, len(x))) for start in range(0, len(x), global_batch)]
    windows = [epoch[first : first + accumulate] for first in range(0, len(epoch), accumulate)]
    for step in range(steps):
        opt.zero_grad()
        for start, end in windows[
            step % len(windows)
        ]:  # (an epoch's last batch is short when the batch does not divide it)
            loss = torch.nn.functional.mse_loss(model(x[start:end]), y[start:end])
            (loss / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if step not in skipped:
            opt.step()
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def run_worker(
    out: Path, *arguments: str, timeout: float = 240, env: Optional[dict[str, str]] = None, launcher: str = "warm"
) -> tuple[int, str]:
    """`pipeline_fit.py --out OUT ARGUMENTS`: (the job's code, every rank's output). ``launcher``: "warm" forks the
    ranks from the warm server (tests/workers/warm_ranks.py), as torchrun starts them; "lightning" runs the script,
    whose rank 0 starts the others through Lightning's launcher, as a user's `python train.py` does."""
    if launcher == "warm":
        argv = ["--out", str(out), *arguments]
        return run_warm_job(argv, devices_in(arguments), timeout, env or {}, script="pipeline_fit")
    assert launcher == "lightning", launcher
    return run_bounded([sys.executable, str(WORKER), "--out", str(out), *arguments], timeout=timeout, env=env)


def run_pipeline(tmp_path: Path, *arguments: str, launcher: str = "warm") -> list[dict[str, torch.Tensor]]:
    out = tmp_path / "out"
    code, output = run_worker(out, *arguments, launcher=launcher)
    assert code == 0, output[-4000:]
    return [torch.load(path) for path in sorted(out.glob("rank*.pt"))]


def largest_difference(reference: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]]) -> float:
    """Every parameter of every rank against the reference's of the same name; every name held by some rank."""
    held = set()
    largest = 0.0
    for state in ranks:
        for name, tensor in state.items():
            largest = max(largest, (tensor - reference[name]).abs().max().item())
            held.add(name)
    assert held == set(reference), f"names no rank holds: {set(reference) - held}"
    return largest


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("devices", "boundaries", "batch"), [(2, "4", 12), (4, "3", 6)], ids=["other-boundaries", "two-pipelines"]
)
def test_a_resume_in_the_middle_equals_the_uninterrupted_run(tmp_path, devices, boundaries, batch):
    """Adam, 2 stages: 4 steps on boundaries [2] with a checkpoint, then a resume to 8 steps on other boundaries, or
    as two pipelines of half the loader batch (the same global batch): one process's 8 steps."""
    first = tmp_path / "first"
    run_pipeline(first, "--boundaries", "2", "--optimizer", "adam", "--steps", "4", "--save-every", "4")
    (saved,) = sorted((first / "out" / "ckpt").iterdir())
    ranks = run_pipeline(
        tmp_path / "resumed",
        "--devices",
        str(devices),
        "--boundaries",
        boundaries,
        "--optimizer",
        "adam",
        "--steps",
        "8",
        "--batch",
        str(batch),
        "--ckpt-path",
        str(saved),
    )
    assert largest_difference(one_process("adam", 8, 12), ranks) <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 2])
def test_a_pipeline_checkpoint_continues_as_data_parallel_as_the_uninterrupted_run(tmp_path, stage):
    """Adam, 2 stages on boundaries [2]: 4 steps with a checkpoint, then 4 more without `pipeline` on 2 data-parallel
    ranks at ZeRO-0 or ZeRO-2 (the same global batch: 6 per rank), from that checkpoint: one process's 8 steps."""
    first = tmp_path / "first"
    run_pipeline(first, "--boundaries", "2", "--optimizer", "adam", "--steps", "4", "--save-every", "4")
    (saved,) = sorted((first / "out" / "ckpt").iterdir())
    ranks = run_pipeline(
        tmp_path / "data-parallel",
        *("--stages", "0", "--zero-stage", str(stage), "--optimizer", "adam", "--steps", "8", "--batch", "6"),
        *("--ckpt-path", str(saved)),
    )
    assert largest_difference(one_process("adam", 8, 12), ranks) <= 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize(("sync_dist", "schedule"), [(False, "1f1b"), (True, "1f1b"), (False, "interleaved")])
def test_validation_runs_through_the_stages(tmp_path, sync_dist, schedule):
    """Validation after step 4 on 2 batches: the last stage (rank 0) logs one process's validation loss; with
    `sync_dist=True` too (reduced over the last stages, which alone log); interleaved, through each rank's chunks in
    turn."""
    arguments = ["--boundaries", "3", "--steps", "4", "--val-every", "4", "--schedule", schedule]
    run_pipeline(tmp_path, *arguments, *(["--sync-dist"] * sync_dist))
    metrics = json.loads((tmp_path / "out" / "rank0.json").read_text())["metrics"]
    seed_everything(1, verbose=False)
    model = ChainModel("sgd")
    model.load_state_dict(one_process("sgd", 4, 12))
    x, y = dataset().tensors
    with torch.no_grad():
        expected = sum(torch.nn.functional.mse_loss(model(x[i : i + 12]), y[i : i + 12]).item() for i in (0, 12)) / 2
    assert metrics["val_loss"] == pytest.approx(expected, abs=1e-5)
    # Every rank sees it (ModelCheckpoint(monitor=...) and EarlyStopping decide alike), and the training loss.
    other = json.loads((tmp_path / "out" / "rank1.json").read_text())["metrics"]
    assert other["val_loss"] == metrics["val_loss"] and other["train_loss"] == metrics["train_loss"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("devices", "batch", "schedule"),
    [(2, 12, "1f1b"), (4, 6, "1f1b"), (2, 12, "interleaved")],
    ids=["one-pipeline", "two-pipelines", "interleaved"],
)
def test_validate_test_and_predict_run_through_the_stages_as_one_process(tmp_path, devices, batch, schedule):
    """After a 4-step fit on boundaries [2], with `sync_dist=True`: validate, test and predict on the 96 samples with
    the fit's Trainer (its stages), then with a freshly built model on a new strategy (3 blocks per stage) from the
    fit's checkpoint. Every rank sees one process's losses, each pipeline's last stage (rank 0 the first's) returns
    one process's predictions of its share of the samples (every other one with two pipelines, as a distributed
    sampler deals them), and the first stages predict nothing of their own."""
    out = tmp_path / "out"
    run_pipeline(
        tmp_path,
        *("--devices", str(devices), "--batch", str(batch), "--boundaries", "2", "--steps", "4"),
        *("--save-every", "4", "--sync-dist", "--evaluate", "--schedule", schedule),
    )
    seed_everything(1, verbose=False)
    reference = ChainModel("sgd")
    reference.load_state_dict(one_process("sgd", 4, 12))
    x, y = dataset().tensors
    with torch.no_grad():
        predictions = reference(x)
    loss = torch.nn.functional.mse_loss(predictions, y).item()
    ranks = [torch.load(out / f"evaluated_rank{rank}.pt") for rank in range(devices)]
    pipelines = devices // 2
    for how in ("after_fit", "from_checkpoint"):
        last_stages = [evaluated[how] for evaluated in ranks if evaluated[how]["stage"] == 1]
        assert ranks[0][how]["stage"] == 1, "rank 0 runs the first pipeline's last stage"
        for pipeline, last_stage in enumerate(last_stages):
            assert last_stage["validate"][0]["val_loss"] == pytest.approx(loss, abs=1e-5), how
            assert last_stage["test"][0]["test_loss"] == pytest.approx(loss, abs=1e-5), how
            share = predictions[pipeline::pipelines]
            assert (torch.cat(last_stage["predict"]) - share).abs().max().item() <= 1e-5, (how, pipeline)
        for evaluated in ranks:
            if evaluated[how]["stage"] == 0:
                assert all(batch is None for batch in evaluated[how]["predict"]), how
            assert evaluated[how]["validate_seen"]["val_loss"] == pytest.approx(loss, abs=1e-5), how
            assert evaluated[how]["test_seen"]["test_loss"] == pytest.approx(loss, abs=1e-5), how


@pytest.mark.multiprocess
def test_a_model_that_fits_no_rank_with_data_parallelism_trains_as_a_pipeline(tmp_path):
    """Blocks of 256 x 256 (1 MiB each counted with Adam's state, 6.2 MiB in all); rank 1's device emulated at 2.5 MiB,
    of which 2 MiB may be planned: below even ZeRO-3's share (3.2 MiB). Data parallelism (Adam) is refused before
    training, naming `pipeline`; the pipeline places one block on rank 1, says so in its plan, and trains exactly."""
    memory = {"LIGHTNING_HETERO_EMULATE_MEMORY": "-,2.5MiB"}
    code, output = run_worker(
        tmp_path / "dp", "--stages", "0", "--width", "256", "--optimizer", "adam", timeout=120, env=memory
    )
    assert code != 0
    assert output.count("do not fit at any stage") == 2 and "Split the model instead of only the batch" in output
    out = tmp_path / "pipeline"
    code, output = run_worker(out, "--width", "256", "--steps", "3", timeout=180, env=memory)
    assert code == 0, output[-4000:]
    (rank1_stage,) = [line for line in output.splitlines() if line.startswith("  stage 0 on rank 1")]
    assert "blocks 0 (1)" in rank1_stage and "of the 2.0 MiB it may use" in rank1_stage
    ranks = [torch.load(path) for path in sorted(out.glob("rank*.pt"))]
    # (SGD with momentum: at this width Adam's first step turns gradient entries that cancel to ~1e-10, summed in
    # another order over 4 micro-batches, into updates of ~1e-4 (2.0e-4 from one process on the whole batch; 0.0
    # from one process accumulating the same 4 micro-batches, measured). Adam's exactness: the tests above.)
    assert largest_difference(one_process("sgd", 3, 12, width=256), ranks) <= 1e-5


@pytest.mark.multiprocess
def test_a_drift_moves_blocks_and_the_update_stays_exact(tmp_path):
    """Rank 1 slows to 0.2 from step 6 (re-plan windows of 4 steps): within two windows blocks move off it (its
    parameters, buffers and Adam state sent to rank 0), and 16 Adam steps still equal one process's."""
    ranks = run_pipeline(
        tmp_path,
        "--speed-schedule",
        '{"0": [1.0, 1.0], "6": [1.0, 0.2]}',
        "--rebalance-window",
        "4",
        "--steps",
        "16",
        "--optimizer",
        "adam",
    )
    replans = json.loads((tmp_path / "out" / "rank0.json").read_text())["replans"]
    assert replans and replans[0]["step"] <= 12, replans  # the windows ending at steps 8 and 12
    blocks_on_rank_1 = sorted({n.split(".")[1] for n in ranks[1] if n.startswith("net.")})
    assert len(blocks_on_rank_1) < 3, blocks_on_rank_1  # fewer than its equal share, after the move
    assert largest_difference(one_process("adam", 16, 12), ranks) <= 1e-5


@pytest.mark.multiprocess
def test_each_stage_trains_in_its_rank_s_precision(tmp_path):
    """`device_precision=["32-true", "bf16-mixed"]`: rank 1's stage computes under bf16 autocast (its blocks end
    near one process's, not equal to them), rank 0's in fp32; the boundary carries fp32 both ways."""
    ranks = run_pipeline(tmp_path, "--boundaries", "3", "--steps", "4", "--device-precision", "32-true,bf16-mixed")
    reference = one_process("sgd", 4, 12)
    stage_0 = {n: t for n, t in ranks[1].items() if n.startswith("net.")}  # rank 1 runs stage 0 (blocks 0-2)
    assert sorted({n.split(".")[1] for n in stage_0}) == ["0", "1", "2"]
    differences = [(t - reference[n]).abs().max().item() for n, t in stage_0.items()]
    assert 1e-6 < max(differences) < 5e-3, differences
    assert largest_difference(reference, ranks) < 5e-3


@pytest.mark.multiprocess
def test_the_monitor_logs_each_stage_s_times(tmp_path):
    """HeteroMonitor under a pipeline: every step's compute and wait per stage and the balance, in the CSV."""
    run_pipeline(tmp_path, "--boundaries", "3", "--steps", "6", "--monitor")
    (metrics,) = (tmp_path / "out" / "logs").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    logged = [row for row in rows if row.get("hetero/stage_0/compute_ms")]
    assert [int(row["step"]) for row in logged] == list(range(6))
    assert all(
        float(row["hetero/stage_1/wait_ms"]) >= 0 and 0 < float(row["hetero/pipeline_balance"]) <= 1 for row in logged
    )


@pytest.mark.multiprocess
def test_a_faster_pipeline_takes_more_of_the_batch_and_the_update_stays_exact(tmp_path):
    """Two pipelines of two stages, the second (ranks 2, 3) emulated at 0.4: placed by measurement, each pipeline's
    share follows its measured throughput (the fast one more than half of the 24 samples), and 4 Adam steps equal
    one process's on the whole batch."""
    code, output = run_worker(
        tmp_path / "out", "--devices", "4", "--speeds", "1.0,1.0,0.4,0.4", "--optimizer", "adam", "--steps", "4"
    )
    assert code == 0, output[-4000:]
    shares = json.loads(re.search(r"the pipelines' shares of the global batch: (\[\d+, \d+\])", output).group(1))
    assert sum(shares) == 24 and shares[0] > 12 > shares[1]
    ranks = [torch.load(path) for path in sorted((tmp_path / "out").glob("rank*.pt"))]
    assert largest_difference(one_process("adam", 4, 24), ranks) <= 1e-5


@pytest.mark.multiprocess
def test_an_epoch_s_short_last_batch_is_weighted_by_its_own_size(tmp_path):
    """96 samples in batches of 10: the tenth step has 6. Its micro-batches' losses are weighted by 6, not 10: 11
    SGD steps (into the next epoch) equal one process's."""
    ranks = run_pipeline(tmp_path, "--boundaries", "3", "--steps", "11", "--batch", "10")
    assert largest_difference(one_process("sgd", 11, 10), ranks) <= 1e-5


CASES = [
    # (devices, stages, boundaries, schedule, optimizer, speeds, micro-batches, launcher); the first as a user's
    # `python train.py` starts it (Lightning's launcher), the others forked from the warm server
    pytest.param(2, 2, "2", "1f1b", "sgd", None, None, "lightning", id="2-stages-uneven-1f1b-sgd"),
    pytest.param(2, 2, "4", "gpipe", "adam", None, None, "warm", id="2-stages-uneven-gpipe-adam"),
    pytest.param(3, 3, "1,4", "1f1b", "adam", None, 5, "warm", id="3-stages-1f1b-adam-5-micro"),
    pytest.param(4, 2, "3", "1f1b", "sgd", "1.0,1.0,0.5,0.5", None, "warm", id="2-pipelines-unequal-speed-sgd"),
    # Interleaved, 2 chunks per rank (each rank holds two non-adjacent parts of the chain)
    pytest.param(2, 2, "3", "interleaved", "adam", None, None, "warm", id="2-stages-interleaved-adam"),
    pytest.param(3, 3, "2,4", "interleaved", "sgd", None, 6, "warm", id="3-stages-interleaved-sgd"),
    pytest.param(4, 2, "3", "interleaved", "adam", "1.0,1.0,0.5,0.5", None, "warm", id="2-pipelines-interleaved"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("devices", "stages", "boundaries", "schedule", "optimizer", "speeds", "micro", "launcher"), CASES
)
def test_a_pipeline_updates_as_one_process(
    tmp_path, devices, stages, boundaries, schedule, optimizer, speeds, micro, launcher
):
    steps, batch = 4, 12
    arguments = [
        "--devices",
        str(devices),
        "--stages",
        str(stages),
        "--boundaries",
        boundaries,
        "--schedule",
        schedule,
        "--optimizer",
        optimizer,
        "--steps",
        str(steps),
        "--batch",
        str(batch),
    ]
    if speeds:
        arguments += ["--speeds", speeds]
    if micro:
        arguments += ["--micro-batches", str(micro)]
    ranks = run_pipeline(tmp_path, *arguments, launcher=launcher)
    assert len(ranks) == devices
    pipelines = devices // stages
    reference = one_process(optimizer, steps, batch * pipelines)
    assert largest_difference(reference, ranks) <= 1e-5
    # Each rank holds only its stage's blocks, under the model's own names.
    blocks_held = [sorted({n.split(".")[1] for n in state if n.startswith("net.")}) for state in ranks]
    assert all(0 < len(held) < 6 for held in blocks_held)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("devices", "clip", "accumulate", "optimizer"),
    [
        pytest.param(2, 0.05, 1, "sgd", id="2-stages-clipped"),
        pytest.param(4, 0.05, 3, "adam", id="2-pipelines-clipped-and-accumulated"),
    ],
)
def test_clipping_over_every_stage_and_accumulation_update_as_one_process(
    tmp_path, devices, clip, accumulate, optimizer
):
    """`gradient_clip_val` clips the whole model's norm (the stages' squared norms summed, each stage once however
    many pipelines hold it), and `accumulate_grad_batches` sums the batches' gradients as one process does."""
    steps, batch = 4, 6
    arguments = ["--devices", str(devices), "--stages", "2", "--boundaries", "3", "--optimizer", optimizer]
    arguments += ["--steps", str(steps), "--batch", str(batch), "--clip", str(clip), "--accumulate", str(accumulate)]
    arguments += ["--speeds", ",".join(["1.0", "0.5"] * (devices // 2))]
    ranks = run_pipeline(tmp_path, *arguments)
    global_batch = batch * (devices // 2)
    reference = one_process(optimizer, steps, global_batch, clip=clip, accumulate=accumulate)
    assert largest_difference(reference, ranks) <= 1e-5
    # The clip and the accumulation were in force: without either, one process ends elsewhere.
    unclipped = one_process(optimizer, steps, global_batch, accumulate=accumulate)
    assert largest_difference(unclipped, ranks) > 1e-3
    if accumulate > 1:
        one_batch_steps = one_process(optimizer, steps, global_batch, clip=clip)
        assert largest_difference(one_batch_steps, ranks) > 1e-3


@pytest.mark.multiprocess
def test_an_inf_gradient_on_one_stage_skips_the_step_on_every_stage(tmp_path):
    """Block 0's gradient is inf at step 1 on stage 0 only: the stages agree on the whole model's norm, so every stage
    skips that step, as one process would, instead of the finite stage stepping alone."""
    steps, batch = 4, 6
    arguments = ["--devices", "2", "--stages", "2", "--boundaries", "3", "--steps", str(steps), "--batch", str(batch)]
    ranks = run_pipeline(tmp_path, *arguments, "--inf-step", "1")
    assert largest_difference(one_process("sgd", steps, batch, skipped=(1,)), ranks) <= 1e-5
    assert largest_difference(one_process("sgd", steps, batch), ranks) > 1e-3  # (the skip changed the run)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("precisions", "inf_step"),
    [("32-true,16-mixed", None), ("16-mixed,32-true", 1)],
    ids=["fp16-first-stage", "fp16-last-stage-inf-on-the-fp32-one"],
)
def test_fp16_stages_scale_their_backward_and_every_stage_skips_an_overflow(tmp_path, precisions, inf_step):
    """An fp16 stage (rank 1 runs stage 0, rank 0 the last) scales its own backward by the job's loss scale and sends
    the stage before it unscaled gradients. Every stage skips the same steps (an fp16 overflow, or an inf that only
    the fp32 stage holding block 0 saw, which the agreed norm catches), each skip halves the one scale, and the blocks
    end near one process that skips those steps (not equal: the fp16 stage computed in fp16)."""
    steps, batch = 4, 6
    out = tmp_path / "out"
    inf = ["--inf-step", str(inf_step)] if inf_step is not None else []
    arguments = ["--boundaries", "3", "--steps", str(steps), "--batch", str(batch), "--device-precision", precisions]
    ranks = run_pipeline(tmp_path, *arguments, *inf)
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    skipped = records[0]["skipped_steps"]
    assert records[1]["skipped_steps"] == skipped
    if inf_step is not None:
        assert inf_step in skipped
    assert [record["precision"]["loss_scale"] for record in records] == [2.0**16 * 0.5 ** len(skipped)] * 2
    reference = one_process("sgd", steps, batch, skipped=tuple(skipped))
    assert largest_difference(reference, ranks) < 2e-3
    fp16_rank = precisions.split(",").index("16-mixed")
    fp16_blocks = {n: t for n, t in ranks[fp16_rank].items() if n.startswith("net.")}
    assert max((t - reference[n]).abs().max().item() for n, t in fp16_blocks.items()) > 1e-7


@pytest.mark.multiprocess
def test_blocks_moved_onto_an_fp16_stage_have_their_gradients_unscaled(tmp_path):
    """Rank 0 trains in fp16 and rank 1 slows to 0.2 from step 6 (windows of 4 steps): blocks move onto rank 0 as new
    tensors, which its gradient hooks take on, so 16 steps end within 2e-3 of one process (before: 1.6e3 off, the
    moved blocks stepping with gradients 2**16 times too large)."""
    schedule = '{"0": [1.0, 1.0], "6": [1.0, 0.2]}'
    arguments = ["--speed-schedule", schedule, "--rebalance-window", "4", "--steps", "16"]
    ranks = run_pipeline(tmp_path, *arguments, "--device-precision", "16-mixed,32-true")
    record = json.loads((tmp_path / "out" / "rank0.json").read_text())
    blocks_on_rank_0 = sorted({n.split(".")[1] for n in ranks[0] if n.startswith("net.")})
    assert record["replans"] and len(blocks_on_rank_0) > 3, (record["replans"], blocks_on_rank_0)
    reference = one_process("sgd", 16, 12, skipped=tuple(record["skipped_steps"]))
    assert largest_difference(reference, ranks) < 2e-3


SETUP = [
    (["--blocks", "layers"], 2, "`blocks` 'layers': ChainModel has no attribute 'layers' (its modules: ['embed',"),
    (["--devices", "3"], 3, "3 ranks cannot form pipelines of `stages` 2; use a number of ranks that is a multiple"),
    (["--stages", "2", "--boundaries", "6"], 2, "`boundaries` [6] must increase strictly, each between 1 and 5"),
    (["--container", "twice"], 2, "`training_step` runs block '1' more than once"),
    (["--iterable"], 2, "HeteroStrategy(pipeline=...) with an IterableDataset: every stage of a pipeline must take"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("arguments", "ranks", "message"), SETUP)
def test_a_pipeline_mistake_stops_every_rank_with_the_message(tmp_path, arguments, ranks, message):
    started = time.monotonic()
    code, output = run_worker(tmp_path, *arguments, timeout=90)
    assert code != 0
    assert output.count(message) == ranks, output[-3000:]
    assert time.monotonic() - started < 90


@pytest.mark.fault
@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_sigterm_to_a_stage_stops_every_rank_with_the_interrupted_exit_code(tmp_path, signalled_rank):
    """SIGTERM to the last stage (rank 0) or the first (rank 1) mid-training: every rank stops with 143 (the ranks
    agree at a step boundary, outside the schedule's sends and receives), none waits for the other."""
    command = [
        sys.executable,
        str(WORKER),
        "--out",
        str(tmp_path),
        "--boundaries",
        "3",
        "--steps",
        "100000",
        "--signal-test",
    ]
    returncode, output, codes = sigterm_mid_training(command, tmp_path, signalled_rank, 2)
    assert returncode != 0, output[-3000:]
    assert codes.get(1) == str(EXIT_CODE_INTERRUPTED), (codes, output[-3000:])
    assert codes.get(0, str(EXIT_CODE_INTERRUPTED)) == str(EXIT_CODE_INTERRUPTED), codes


@pytest.mark.fault
@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_lost_stage_stops_the_other_within_the_peer_timeout(tmp_path, how):
    """Rank 1 (the last stage) SIGKILLs or SIGSTOPs itself at step 2, while rank 0 waits for its gradient. Killed:
    Lightning's launcher (rank 0's process) ends the job. Frozen (its sockets stay open, so no send or receive
    breaks): the heartbeat watchdog or the receive's deadline stops rank 0 within the peer timeout, naming rank 1.
    Nothing waits longer."""
    command = [
        sys.executable,
        str(WORKER),
        "--out",
        str(tmp_path),
        "--boundaries",
        "3",
        "--kill",
        "1:2" + (":freeze" if how == "freeze" else ""),
        "--steps",
        "1000",
        "--peer-timeout",
        "5",
    ]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    started = time.monotonic()
    try:
        while process.poll() is None and time.monotonic() - started < 90:
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the frozen rank, by its process group
    output = process.communicate()[0]
    assert process.returncode not in (0, None), output[-3000:]
    assert elapsed < 60, f"rank 0 still ran {elapsed:.0f} s after the start: {output[-3000:]}"
    if how == "freeze":  # the heartbeat or the receive's own deadline, whichever ends first: both name rank 1
        heartbeat = "rank 1 has been lost: no heartbeat came for 5 s" in output
        deadline = re.search(r"rank 0 stopped waiting for .* with rank 1 \(deadline 5 s\)", output)
        assert heartbeat or deadline, output[-3000:]
    else:
        assert "terminated with code -9" in output or "rank 1" in output, output[-3000:]


def state_holders(out: Path) -> list[list[str]]:
    """Each rank's parameters that its optimizer keeps state for (the worker's record)."""
    records = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    return [record["optimizer_state_names"] for record in records]


def held_bytes(ranks: list[dict[str, torch.Tensor]], names: list[str], rank: int) -> int:
    return sum(ranks[rank][name].numel() * ranks[rank][name].element_size() for name in names)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("shards", "optimizer", "width"), [("equal", "adam", WIDTH), ("equal", "adagrad", WIDTH), ("memory", "sgd", 256)]
)
def test_stage_1_shards_each_stage_s_optimizer_state_over_its_pipelines_and_updates_as_one_process(
    tmp_path, shards, optimizer, width
):
    """Two pipelines of two stages at `stage=1`, clipped at 0.05: each parameter's optimizer state is on exactly one
    rank of those holding it, and 4 steps equal one process's on the whole batch.

    `shards="memory"`: blocks of 256 x 256 (a stage holds 3 MiB counted with Adam's state); rank 3's device emulated
    at 2.5 MiB (2.0 MiB may be planned): ZeRO-0 (the whole stage, 3.0 MiB) and equal shards (2.3 MiB) do not fit it,
    and memory-sized shards do, giving it a small share of its stage's state (its room after the parameters and
    gradients: 0.5 MiB of rank 1's 4.9). (SGD with momentum at that width: Adam's first step turns gradient entries
    that cancel to ~1e-10, summed in another order, into updates of ~1e-4, sharded or not: 4.19e-5 both ways,
    measured.)

    Adagrad makes its state for every parameter when it is built: the ranks that do not own a parameter drop it."""
    arguments = ["--devices", "4", "--boundaries", "3", "--width", str(width), "--optimizer", optimizer]
    arguments += ["--steps", "4", "--batch", "6", "--clip", "0.05", "--zero-stage", "1", "--shards", shards]
    memory = {"LIGHTNING_HETERO_EMULATE_MEMORY": "8MiB,8MiB,8MiB,2.5MiB"} if shards == "memory" else {}
    if shards == "memory":  # what does not fit it
        for refused in (["--zero-stage", "0", "--shards", "equal"], ["--zero-stage", "1", "--shards", "equal"]):
            code, output = run_worker(tmp_path / "refused", *arguments, *refused, timeout=120, env=memory)
            assert code != 0 and "needs" in output and "above its 2.0 MiB" in output, output[-3000:]
    out = tmp_path / "out"
    code, output = run_worker(out, *arguments, timeout=240, env=memory)
    assert code == 0, output[-4000:]
    ranks = [torch.load(path) for path in sorted(out.glob("rank*.pt"))]
    assert largest_difference(one_process(optimizer, 4, 12, width=width, clip=0.05), ranks) <= 1e-5
    holders = state_holders(out)
    for name, _ in ChainModel(width=width).named_parameters():  # each parameter's state on exactly one rank
        assert sum(name in held for held in holders) == 1, (name, holders)
    stages = [sorted({n.split(".")[1] for n in state if n.startswith("net.")}) for state in ranks]
    assert stages[1] == stages[3] == ["0", "1", "2"]  # (stage 0 on ranks 1 and 3: rank 0 runs the last stage)
    rank_1, rank_3 = (held_bytes(ranks, [n for n in holders[r] if n.startswith("net.")], r) for r in (1, 3))
    assert rank_1 > 0 and rank_3 > 0
    if shards == "equal":  # within one parameter (a weight) of half each
        assert abs(rank_1 - rank_3) <= (width * width + 2 * width) * 4, (rank_1, rank_3)
    else:
        assert rank_3 < rank_1 / 4, (rank_1, rank_3)
        assert "optimizer state of stage 0 sharded (in proportion to the memory left after activations)" in output


@pytest.mark.multiprocess
def test_a_sharded_checkpoint_resumes_unsharded_and_sharded_as_the_uninterrupted_run(tmp_path):
    """4 Adam steps as two pipelines at `stage=1` (each rank saves the state it owns), then 4 more from that
    checkpoint as one pipeline of 2 ranks without shards, and as two pipelines with other boundaries and equal
    shards: both are one process's 8 steps."""
    first = tmp_path / "first"
    arguments = ["--devices", "4", "--boundaries", "2", "--optimizer", "adam", "--batch", "6", "--zero-stage", "1"]
    run_pipeline(first, *arguments, "--steps", "4", "--save-every", "4")
    (saved,) = sorted((first / "out" / "ckpt").iterdir())
    reference = one_process("adam", 8, 12)
    unsharded = run_pipeline(
        tmp_path / "unsharded", "--boundaries", "4", "--optimizer", "adam", "--steps", "8", "--ckpt-path", str(saved)
    )
    assert largest_difference(reference, unsharded) <= 1e-5
    resharded = run_pipeline(
        tmp_path / "resharded",
        *("--devices", "4", "--boundaries", "4", "--optimizer", "adam", "--batch", "6", "--zero-stage", "1"),
        *("--steps", "8", "--ckpt-path", str(saved)),
    )
    assert largest_difference(reference, resharded) <= 1e-5
    holders = state_holders(tmp_path / "resharded" / "out")
    assert all(sum(name in held for held in holders) == 1 for name in reference)


@pytest.mark.multiprocess
def test_blocks_moved_between_sharded_stages_keep_every_parameter_s_state_once(tmp_path):
    """Two pipelines at `stage=1`; ranks 1 and 3 slow to 0.2 from step 6 (windows of 4 steps): blocks move off
    their stage, each moved parameter's Adam state (spread over the copies that held it) reaches its new owner, and
    16 steps equal one process's."""
    ranks = run_pipeline(
        tmp_path,
        *("--devices", "4", "--batch", "6", "--zero-stage", "1", "--optimizer", "adam", "--steps", "16"),
        *("--speed-schedule", '{"0": [1.0, 1.0, 1.0, 1.0], "6": [1.0, 0.2, 1.0, 0.2]}', "--rebalance-window", "4"),
    )
    replans = json.loads((tmp_path / "out" / "rank0.json").read_text())["replans"]
    assert replans, "no block moved"
    assert largest_difference(one_process("adam", 16, 12), ranks) <= 1e-5
    holders = state_holders(tmp_path / "out")
    assert all(sum(name in held for held in holders) == 1 for name in one_process("adam", 0, 12))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("stage", "devices", "sharded"), [(0, 2, False), (2, 4, True), (3, 2, False)], ids=["zero-0", "zero-2", "zero-3"]
)
def test_a_data_parallel_checkpoint_continues_as_a_pipeline_as_the_uninterrupted_run(tmp_path, stage, devices, sharded):
    """Adam: 4 steps data parallel on 2 ranks at ZeRO-0 (its optimizer's parameter names in the manifest), ZeRO-2 or
    ZeRO-3 (read through DeepSpeed's universal copy), with a checkpoint; then 4 more from it as one pipeline of 2
    stages, or as two pipelines at `stage=1` (the same global batch of 12): one process's 8 steps."""
    first = tmp_path / "first"
    run_pipeline(
        first,
        *("--stages", "0", "--zero-stage", str(stage), "--optimizer", "adam", "--steps", "4", "--batch", "6"),
        *("--save-every", "4"),
    )
    (saved,) = sorted((first / "out" / "ckpt").iterdir())
    arguments = ["--devices", str(devices), "--boundaries", "2", "--optimizer", "adam", "--steps", "8"]
    arguments += ["--batch", str(24 // devices), "--ckpt-path", str(saved)]
    if sharded:
        arguments += ["--zero-stage", "1"]
    ranks = run_pipeline(tmp_path / "pipeline", *arguments)
    assert largest_difference(one_process("adam", 8, 12), ranks) <= 1e-5
    if sharded:
        holders = state_holders(tmp_path / "pipeline" / "out")
        assert all(sum(name in held for held in holders) == 1 for name in one_process("adam", 0, 12))


@pytest.mark.multiprocess
def test_an_interleaved_step_whose_micro_batches_do_not_divide_into_the_stages_runs_gpipe_s_order(tmp_path):
    """Batches of 3 on 2 interleaved stages: 3 micro-batches a step, which the interleaved order could deadlock on,
    so each step runs GPipe's order over the chunks; 4 Adam steps equal one process's."""
    ranks = run_pipeline(
        tmp_path, *("--boundaries", "3", "--schedule", "interleaved", "--optimizer", "adam"), "--batch", "3"
    )
    assert largest_difference(one_process("adam", 4, 3), ranks) <= 1e-5
