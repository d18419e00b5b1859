"""Fault tolerance with real processes: a lost rank never hangs the others; torchrun restarts resume exactly; a
SIGTERM saves a complete checkpoint first. Each test kills processes it started, by PID, and is bounded."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, WORKERS, free_port, kill_tree, run_bounded, run_fit

sys.path.insert(0, str(WORKERS))
from common import (  # noqa: E402
    IndexedRegression,
    batchnorm_reference_training,
    max_param_difference,
    reference_training,
)
from torch.utils.data import RandomSampler  # noqa: E402

from lightning_hetero.recover import checkpoint  # noqa: E402
from lightning_hetero.recover.liveness import EXIT_CODE_PEER_LOST  # noqa: E402
from lightning_hetero.recover.refusal import EXIT_CODE_WILL_FAIL_AGAIN  # noqa: E402
from lightning_hetero.recover.stopping import EXIT_CODE_INTERRUPTED  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5


def contiguous_steps(num_samples, global_batch):
    return [list(range(k, k + global_batch)) for k in range(0, num_samples, global_batch)]


def start_fit(out, *args, env=None):
    command = [sys.executable, str(WORKERS / "fit.py"), "--out", str(out), *args]
    environment = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=environment,
    )


def wait_for_pids(out, process, ranks, timeout=120):
    deadline = time.monotonic() + timeout
    files = [out / f"pid_rank{rank}" for rank in ranks]
    while not all(f.exists() and f.read_text() for f in files):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


def alive(pids):
    """The given processes that still run (zombies waiting to be reaped do not)."""
    running = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
    return running


@pytest.mark.fault
@pytest.mark.parametrize(
    ("victim", "how"), [(0, signal.SIGKILL), (1, signal.SIGKILL), (1, signal.SIGSTOP), (0, signal.SIGSTOP)]
)
def test_a_lost_rank_never_leaves_the_others_waiting(victim, how, tmp_path):
    """SIGKILL of rank 0 or 1 (nothing published, maybe nothing broken), or rank 1 frozen (SIGSTOP: its sockets stay
    open, so no collective ever breaks), or rank 0 frozen, which hosts the rendezvous store under Lightning's
    launcher (a store call to it blocks until it runs again): every other process is gone within 60 s, having said
    why; peer_timeout=5 here (benchmarks/faults.py measures how soon)."""
    process = start_fit(
        tmp_path,
        "--batch-sizes",
        "8",
        "8",
        "--max-epochs",
        "100000",
        "--signal-test",
        "--strategy-args",
        '{"peer_timeout": 5}',
    )
    try:
        pids = wait_for_pids(tmp_path, process, [0, 1])
        killed_at = time.monotonic()
        os.kill(pids[victim], how)
        others = [pid for rank, pid in enumerate(pids) if rank != victim]
        while alive(others) and time.monotonic() - killed_at < 60:
            process.poll()  # reap rank 0, the launcher's process, when it is one of the others
            time.sleep(0.1)
        gone_after = time.monotonic() - killed_at
        print(f"{how.name} to rank {victim}: the other ranks were gone {gone_after:.1f} s later")
        assert not alive(others), f"still running {gone_after:.0f} s after the kill: {alive(others)}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    output = process.communicate()[0]
    if how == signal.SIGSTOP and victim == 1:  # only the heartbeat can notice a frozen peer
        assert "rank 1 has been lost: no heartbeat came for 5 s" in output, output[-3000:]
        assert process.returncode == EXIT_CODE_PEER_LOST, output[-3000:]
    elif how == signal.SIGSTOP:  # rank 1 said so before exiting; rank 0, still frozen, was killed by the test
        # Either the store went silent first, or (rank 0's heartbeat thread starved just before the stop, seen under
        # load) rank 0's counter did: both name rank 0 and the store it hosts.
        said = re.search(
            r"rank 0 has been lost: (the rendezvous store stopped answering \(rank 0 hosts it\) for 5 s"
            r"|no heartbeat came for 5 s and the rendezvous store \(rank 0 hosts it\) has not answered)",
            output,
        )
        assert said, output[-3000:]
    elif victim == 0:  # rank 1 noticed (the watchdog or a broken collective), named what was lost, and exited 75
        assert "exits with code 75" in output, output[-3000:]
    else:  # rank 0, Lightning's launcher, saw its child die and ended the job itself (before anything of ours)
        assert "terminated with code -9" in output or "exits with code 75" in output, output[-3000:]


@pytest.mark.fault
def test_a_frozen_rank_never_leaves_the_other_waiting_for_an_overlapped_merge(tmp_path):
    """DiLoCo with overlapped merges every 2 steps: rank 0 waits on rank 1 either in a merge's exchange started in
    the background or in the blocking sum of the sample counts. Rank 1 frozen (SIGSTOP: no collective ever breaks),
    the heartbeat names it within peer_timeout=5 and rank 0 exits, as for the every-step exchange above."""
    arguments = json.dumps({"peer_timeout": 5, "sync": "diloco", "sync_every": 2, "sync_options": {"overlap": True}})
    process = start_fit(
        tmp_path,
        "--stage",
        "0",
        "--batch-sizes",
        "8",
        "8",
        "--max-epochs",
        "100000",
        "--signal-test",
        "--strategy-args",
        arguments,
    )
    try:
        pids = wait_for_pids(tmp_path, process, [0, 1])
        stopped_at = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        while alive([pids[0]]) and time.monotonic() - stopped_at < 60:
            process.poll()
            time.sleep(0.1)
        assert not alive([pids[0]]), f"rank 0 still running {time.monotonic() - stopped_at:.0f} s after the stop"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    output = process.communicate()[0]
    assert "rank 1 has been lost: no heartbeat came for 5 s" in output, output[-3000:]
    assert "each merge is sent in the background" in output, output[-3000:]


@pytest.mark.fault
def test_a_frozen_torchrun_agent_stops_both_workers_naming_the_store(tmp_path):
    """The agent hosts the store under torchrun: frozen (SIGSTOP), every store call to it blocks until it runs again,
    whatever the store's timeout. Both workers notice within the peer timeout all the same and exit naming it."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        str(WORKERS / "fit.py"),
        "--out",
        str(tmp_path),
        "--batch-sizes",
        "8",
        "8",
        "--max-epochs",
        "100000",
        "--signal-test",
        "--strategy-args",
        '{"peer_timeout": 5}',
    ]
    agent = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    workers = []
    try:
        workers = wait_for_pids(tmp_path, agent, [0, 1])
        frozen_at = time.monotonic()
        os.kill(agent.pid, signal.SIGSTOP)
        while alive(workers) and time.monotonic() - frozen_at < 60:
            time.sleep(0.1)
        print(f"the workers were gone {time.monotonic() - frozen_at:.1f} s after the agent froze")
        assert not alive(workers), "a worker waited for the frozen agent"
    finally:
        for pid in [agent.pid, *workers]:  # torchrun gives each worker a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    output = agent.communicate()[0]
    for rank, peer in ((0, 1), (1, 0)):
        # Its watchdog saw the store go silent, or (when the other rank's watchdog fired first and its exit broke
        # this rank's collective) the broken collective found the store gone: both name the agent and exit 75.
        # The watchdog may also see the peer's counter stop first (its last beat can precede the store's last answer
        # by one heartbeat): then it names both, the peer and the silent store the agent hosts (liveness.lost_message).
        watchdog = re.search(
            rf"rank {peer} has been lost: (the rendezvous store stopped answering \(the torchrun agent hosts it\)"
            r"|no heartbeat came for 5 s and the rendezvous store \(the torchrun agent hosts it\) has not answered)",
            output,
        )
        collective = (
            f"rank {rank} lost its connection to the other ranks, and the torchrun agent, which hosts the"
            " rendezvous store, no longer answers"
        )
        assert watchdog or collective in output, output[-3000:]
        assert f"Rank {rank} exits with code 75" in output, output[-3000:]


def torchrun(out, *args, restarts=1, timeout=300):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.5",
        str(WORKERS / "fit.py"),
        "--out",
        str(out),
        *args,
    ]
    return run_bounded(command, timeout, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.fault
@pytest.mark.parametrize("where", ["step", "checkpoint"])
def test_torchrun_restarts_after_a_sigkill_and_the_run_equals_an_uninterrupted_one(where, tmp_path):
    """Rank 1 SIGKILLs itself (after a step drawn at random, or while the checkpoint of step 8 is being written):
    torchrun restarts both workers, `fit(ckpt_path="last")` resumes from the last complete checkpoint (step 4 when the
    save of step 8 was killed), and the job finishes with every sample of each epoch used once (the steps after
    that checkpoint counted once) and the parameters of an uninterrupted run."""
    step = random.Random().randrange(1, 12) if where == "step" else 8  # 12 steps in all
    print(f"fault injection: rank 1 at step {step} ({where})")  # to reproduce a failure
    returncode, output = torchrun(
        tmp_path,
        "--batch-sizes",
        "10",
        "6",
        "--samples",
        "96",
        "--max-epochs",
        "2",
        "--checkpoint-every",
        "4",
        "--save-last",
        "--ckpt-path",
        "last",
        "--record-steps",
        "--kill",
        f"1:{step}:{where}",
    )
    assert returncode == 0, output[-4000:]
    assert f"rank 1 SIGKILLs itself at step {step}" in output
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    resumed_at = min(r["step"] for r in records if r["attempt"] == 1)
    if where == "checkpoint":
        assert resumed_at == 4, resumed_at  # the save of step 8 never published: last.ckpt was step 4's
    # What the finished job trained: the first attempt up to the checkpoint, then the second attempt.
    kept = [r for r in records if (r["attempt"] == 0 and r["step"] < resumed_at) or r["attempt"] == 1]
    for epoch in (0, 1):
        used = sorted(i for r in kept if r["epoch"] == epoch for i in r["indices"])
        assert used == list(range(96)), f"epoch {epoch}"
    batches = {}
    for r in kept:
        batches.setdefault(r["step"], {})[r["rank"]] = r["indices"]
    steps = [batches[s][0] + batches[s][1] for s in sorted(batches)]
    assert len(steps) == 12
    result = json.loads((tmp_path / "result.json").read_text())
    difference = max_param_difference(result, reference_training(IndexedRegression(96), steps))
    print(f"largest parameter difference from the uninterrupted run: {difference:.1e}")
    assert difference <= TOLERANCE, difference
    assert checkpoint.incompleteness(tmp_path / "ckpt" / "last.ckpt") is None


@pytest.mark.fault
@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_sigterm_saves_a_complete_checkpoint_where_the_ranks_next_agree_and_the_resume_loses_no_sample(
    signalled_rank, tmp_path
):
    """SIGTERM (spot preemption, Slurm's warning) to one rank: every rank stops before the same step (where they next
    agree on it: within about a second of training), saves ckpt/last.ckpt with every step trained so far, and exits
    143; the resume trains the rest of the epoch."""
    common = ["--batch-sizes", "8", "8", "--samples", "160", "--checkpoint-every", "1000", "--record-steps"]
    process = start_fit(tmp_path, *common, "--max-epochs", "100000", "--signal-test")
    try:
        (pid,) = wait_for_pids(tmp_path, process, [signalled_rank])
        os.kill(pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == EXIT_CODE_INTERRUPTED or (signalled_rank == 1 and process.returncode == -9), output
    # Every rank that recorded its exit stopped with 143; rank 0 may instead be killed by Lightning's launcher (-9)
    # when it sees rank 1 exit non-zero first: never 0 either way.
    assert (tmp_path / "exit_rank1").read_text() == str(EXIT_CODE_INTERRUPTED)
    if (tmp_path / "exit_rank0").exists():
        assert (tmp_path / "exit_rank0").read_text() == str(EXIT_CODE_INTERRUPTED)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert checkpoint.incompleteness(last) is None, output[-3000:]
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    trained = max(r["step"] for r in records) + 1
    assert checkpoint.read_manifest(last)["global_step"] == trained  # every step trained is in it
    epoch = trained // 10  # 10 steps per epoch: the epoch the signal interrupted (steps are fast: not always 0)
    resume = tmp_path / "resume"
    resumed_run = run_fit(resume, *common, "--max-epochs", str(epoch + 1), "--ckpt-path", str(last))
    assert resumed_run.returncode == 0, resumed_run.output[-3000:]
    resumed = [json.loads(line) for line in (resume / "steps.jsonl").read_text().splitlines()]
    assert min(r["step"] for r in resumed) == trained  # no step trained twice, none skipped
    used = sorted(i for r in records + resumed if r["epoch"] == epoch for i in r["indices"])
    assert used == list(range(160))  # that epoch: each sample once across the interruption


# Resumed on another number of ranks: ZeRO-0 (whole states on every rank) with SGD; ZeRO 1-3 with every optimizer whose
# state is per parameter (SGD's momentum, RMSprop's three tensors, Adagrad's sums, Adam's moments, AdamW's amsgrad
# maximum, which DeepSpeed's own converter left out); NAdam (its mu_product is a number that is not the step) refused.
PER_PARAMETER = ("sgd", "rmsprop", "adagrad", "adam", "adamw")
RESIZED = [(0, "sgd")] + [(stage, name) for stage in (1, 2, 3) for name in PER_PARAMETER]
REFUSED = (2, "nadam")


@pytest.mark.fault
def test_checkpoints_of_2_ranks_resume_on_1_and_on_3_ranks_as_the_uninterrupted_runs_for_every_per_parameter_state(
    tmp_path,
):
    """Three jobs, a fit per case in each (global batch 16, 6 steps): 2 ranks train every case and save at step 3;
    1 rank (whose default global batch, 8, gives way to the checkpoint's 16) and 3 ranks (micro-batches 6/5/5) resume
    each checkpoint, converted to DeepSpeed's universal layout once (cached inside it), and finish the epoch with the
    parameters of one process trained on the same global batches. The NAdam checkpoint is refused on 1 rank, saying
    what to do, with exit code 78 (a restart would be refused alike); it used to fail inside DeepSpeed's converter."""
    common = ["--samples", "96", "--max-epochs", "1"]

    def case(directory, stage, name, *more):
        out = tmp_path / directory / f"{name}{stage}"
        return ["--out", str(out), "--stage", str(stage), "--optimizer", name, *more]

    first = run_fit(
        tmp_path / "two",
        *common,
        "--batch-sizes",
        "8",
        "8",
        "--checkpoint-every",
        "3",
        "--each",
        json.dumps([case("two", s, n) for s, n in [*RESIZED, REFUSED]]),
        timeout=400,
    )
    assert first.returncode == 0, first.output[-3000:]
    references = {
        name: reference_training(IndexedRegression(96), contiguous_steps(96, 16), optimizer_name=name)
        for name in {n for _, n in [*RESIZED, REFUSED]}
    }
    for stage, name in [*RESIZED, REFUSED]:  # the uninterrupted runs
        result = json.loads((tmp_path / "two" / f"{name}{stage}" / "result.json").read_text())
        assert max_param_difference(result, references[name]) <= TOLERANCE, (stage, name)

    def saved(stage, name):
        return str(tmp_path / "two" / f"{name}{stage}" / "ckpt" / "epoch=0-step=3.ckpt")

    one = run_fit(
        tmp_path / "one",
        *common,
        "--devices",
        "1",
        "--each",
        json.dumps([case("one", s, n, "--ckpt-path", saved(s, n)) for s, n in [*RESIZED, REFUSED]]),
        timeout=400,
    )
    three = run_fit(
        tmp_path / "three",
        *common,
        "--devices",
        "3",
        "--batch-sizes",
        "6",
        "5",
        "5",
        "--each",
        json.dumps([case("three", s, n, "--ckpt-path", saved(s, n)) for s, n in RESIZED]),
        timeout=400,
    )
    assert three.returncode == 0, three.output[-3000:]
    for directory, run in (("one", one), ("three", three)):
        for stage, name in RESIZED:
            result_file = tmp_path / directory / f"{name}{stage}" / "result.json"
            assert result_file.exists(), (directory, stage, name, run.output[-3000:])
            result = json.loads(result_file.read_text())
            assert result["global_step"] == 6
            assert sorted(sum(result["seen"], [])) == list(range(48, 96))  # the rest of the epoch, once
            difference = max_param_difference(result, references[name])
            ranks = len(result["seen"])
            print(f"ZeRO-{stage} {name}, 2 -> {ranks} ranks: largest parameter difference {difference:.1e}")
            assert difference <= TOLERANCE, (directory, stage, name, difference)
            if stage:
                assert f"{saved(stage, name)} was saved by 2 ranks; this job has {ranks}:" in run.output
                assert checkpoint.incompleteness(Path(saved(stage, name))) is None
    assert three.output.count("using the universal copy") == len(RESIZED) - 1  # converted once (ZeRO-0 needs none)
    stage, name = REFUSED
    assert one.returncode == EXIT_CODE_WILL_FAIL_AGAIN, one.output[-3000:]
    refusal = (
        f"Checkpoint {saved(stage, name)} was saved by 2 ranks with ZeRO-2; this job has 1. ZeRO splits the"
        " optimizer state by rank, and resuming on another number of ranks cuts it per parameter and splits it"
        " again, but the NAdam optimizer keeps state that is not per parameter: 'mu_product' (a number that is"
        " not the step). Resume on 2 ranks"
    )
    assert refusal in one.output and "exits with code 78 (retrying cannot help)" in one.output, one.output[-3000:]


@pytest.mark.fault
def test_a_resume_on_another_number_of_ranks_keeps_the_buffers_at_zero_2_and_3(tmp_path):
    """DeepSpeed's universal load skips the module's state dict (it loads the parameters from the per-parameter
    files): a BatchNorm's running statistics came back as a fresh model's. 2 ranks (synchronized BatchNorm, 8 + 8)
    save at step 3; 1 rank resumes at ZeRO-2 and ZeRO-3 and ends the epoch with one process's parameters and running
    statistics on the global batch of 16."""
    common = ["--samples", "96", "--max-epochs", "1", "--batchnorm"]
    stages = (2, 3)
    first = run_fit(
        tmp_path / "two",
        *common,
        "--batch-sizes",
        "8",
        "8",
        "--sync-batchnorm",
        "--checkpoint-every",
        "3",
        "--each",
        json.dumps([["--out", str(tmp_path / "two" / str(stage)), "--stage", str(stage)] for stage in stages]),
        timeout=400,
    )
    assert first.returncode == 0, first.output[-3000:]
    resumed = [
        ["--out", str(tmp_path / "one" / str(stage)), "--stage", str(stage), "--ckpt-path"]
        + [str(tmp_path / "two" / str(stage) / "ckpt" / "epoch=0-step=3.ckpt")]
        for stage in stages
    ]
    one = run_fit(tmp_path / "one", *common, "--devices", "1", "--each", json.dumps(resumed), timeout=400)
    assert one.returncode == 0, one.output[-3000:]
    parameters, statistics = batchnorm_reference_training(
        IndexedRegression(96), contiguous_steps(96, 16), [8, 8], [1, 1]
    )
    for stage in stages:
        result = json.loads((tmp_path / "one" / str(stage) / "result.json").read_text())
        assert result["global_step"] == 6 and sorted(sum(result["seen"], [])) == list(range(48, 96))
        trained = {name.removeprefix("network."): torch.tensor(v) for name, v in result["running_statistics"].items()}
        assert trained.keys() == statistics.keys()
        differences = {name: (trained[name] - value.double()).abs().max().item() for name, value in statistics.items()}
        print(f"ZeRO-{stage}, 2 -> 1 rank: running statistics {differences}")
        assert max_param_difference(result, parameters) <= TOLERANCE, stage
        assert max(differences.values()) <= TOLERANCE, (stage, differences)


@pytest.mark.fault
def test_lr_scaling_on_a_resize_scales_the_learning_rate_and_adamw_decay_by_its_rule(tmp_path):
    """2 ranks x 8 (global batch 16) train AdamW (lr 0.01, weight decay 0.01) and save at step 3. 1 rank resumes,
    whose default global batch is 8 (k = 1/2). With `lr_scaling="sqrt"` it trains on with 8: lr x sqrt(k), and the
    decoupled weight decay x k / sqrt(k), so that lr x weight decay scales by k; with "linear": lr x k, the decay kept;
    without it (the default) the checkpoint's global batch of 16 and its rates are kept. Each says so, and each rate
    is in force from the resumed fit's first batch."""
    common = ["--samples", "96", "--max-epochs", "1", "--optimizer", "adamw"]
    first = run_fit(tmp_path / "two", *common, "--batch-sizes", "8", "8", "--checkpoint-every", "3")
    assert first.returncode == 0, first.output[-3000:]
    saved = str(tmp_path / "two" / "ckpt" / "epoch=0-step=3.ckpt")
    cases = {"sqrt": {"lr_scaling": "sqrt"}, "linear": {"lr_scaling": "linear"}, "default": {}}
    one = run_fit(
        tmp_path / "one",
        *common,
        "--devices",
        "1",
        "--each",
        json.dumps(
            [
                ["--out", str(tmp_path / "one" / name), "--ckpt-path", saved, "--strategy-args", json.dumps(arguments)]
                for name, arguments in cases.items()
            ]
        ),
        timeout=300,
    )
    assert one.returncode == 0, one.output[-3000:]
    lr, decay, k = 0.05 / 5, 0.01, 8 / 16  # (tests/workers/common.py's AdamW)
    expected = {
        "sqrt": (lr * math.sqrt(k), decay * math.sqrt(k), 9),
        "linear": (lr * k, decay, 9),
        "default": (lr, decay, 6),
    }
    for name, (scaled_lr, scaled_decay, steps) in expected.items():
        result = json.loads((tmp_path / "one" / name / "result.json").read_text())
        (group,) = result["param_groups"]
        assert group["lr"] == pytest.approx(scaled_lr, rel=1e-12), name
        assert group["weight_decay"] == pytest.approx(scaled_decay, rel=1e-12), name
        assert group["lr"] * group["weight_decay"] == pytest.approx(lr * decay * (k if name != "default" else 1))
        # Scaled from the fit's first batch on, before any step: a checkpoint saved then (a SIGTERM just after the
        # restart) records the scaled rates with the new global batch (the scaling waited for the first optimizer
        # step, and such a checkpoint lost it for good)
        (first,) = result["first_batch_param_groups"]
        assert (first["lr"], first["weight_decay"]) == pytest.approx((scaled_lr, scaled_decay), rel=1e-12), name
        assert result["global_step"] == steps, name  # 3 steps of 16, then 6 of 8 (or 3 of 16)
        assert sorted(sum(result["seen"], [])) == list(range(48, 96)), name  # the rest of the epoch, once
    line = "HeteroStrategy: the global batch changed from the checkpoint's 16 to 8 samples (x0.5); lr_scaling="
    assert f"{line}'sqrt': learning rate x0.7071, decoupled weight decay x0.7071" in one.output
    assert f"{line}'linear': learning rate x0.5, decoupled weight decay x1 " in one.output
    assert "keeping the checkpoint's global batch of 16 on 1 ranks" in one.output


@pytest.mark.fault
def test_a_second_job_saving_into_the_same_directory_is_refused_and_the_first_goes_on(tmp_path):
    """Job A trains and saves into a directory; job B, started on the same directory, must not delete A's staging
    directory as a leftover (A then died with FileNotFoundError): B's first save is refused on both of its ranks,
    naming A, and A goes on to save a complete checkpoint."""
    shared = tmp_path / "checkpoints"
    first = start_fit(
        tmp_path / "a",
        "--batch-sizes",
        "8",
        "8",
        "--samples",
        "160",
        "--max-epochs",
        "100000",
        "--checkpoint-every",
        "5",
        "--checkpoint-dir",
        str(shared),
        "--signal-test",
    )
    try:
        (rank0,) = wait_for_pids(tmp_path / "a", first, [0])
        while not any(p.name.endswith(".ckpt") for p in shared.glob("*")):
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.1)
        second = run_fit(
            tmp_path / "b",
            "--batch-sizes",
            "8",
            "8",
            "--max-steps",
            "3",
            "--checkpoint-every",
            "1",
            "--checkpoint-dir",
            str(shared),
            timeout=180,
        )
        assert second.returncode != 0
        refusal = f"another job is saving checkpoints into {shared} (process {rank0} on"
        assert refusal in second.output and second.output.count("preparing the checkpoint") >= 1, second.output[-3000:]
        assert first.poll() is None, "the first job stopped"
        os.kill(rank0, signal.SIGTERM)  # the first job saves last.ckpt and exits 143
        output, _ = first.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == EXIT_CODE_INTERRUPTED, output[-3000:]
    assert checkpoint.incompleteness(shared / "last.ckpt", verify_checksums=True) is None
    assert not [p.name for p in shared.iterdir() if p.name.endswith(".partial")]


@pytest.mark.fault
def test_a_full_disk_stops_every_rank_saying_so_and_keeps_the_previous_checkpoint(tmp_path):
    """Rank 1's writes fail with ENOSPC from the save of step 4 on: both ranks stop with the reason and the path, the
    partial save is removed, and last.ckpt is still the complete checkpoint of step 2."""
    run = run_fit(
        tmp_path,
        "--batch-sizes",
        "8",
        "8",
        "--max-steps",
        "6",
        "--checkpoint-every",
        "2",
        "--save-last",
        "--disk-full-at",
        "4",
        timeout=180,
    )
    assert run.returncode != 0
    message = "No space left on device (ENOSPC) while writing checkpoint"
    assert run.output.count(message) >= 2, run.output[-4000:]  # rank 1 raises it, rank 0 names rank 1 and it
    assert "writing the checkpoint failed on rank 1" in run.output
    directory = tmp_path / "ckpt"
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".hetero")) == [
        "epoch=0-step=2.ckpt",
        "last.ckpt",
    ]
    assert checkpoint.read_manifest(directory / "last.ckpt")["global_step"] == 2
    assert checkpoint.incompleteness(directory / "last.ckpt", verify_checksums=True) is None


def test_a_damaged_last_checkpoint_is_skipped_for_a_sound_one_of_the_same_step(tmp_path):
    """A byte of last.ckpt damaged in place (same size): `ckpt_path="last"` used to choose it on every restart and
    fail ('pop from empty list'); the resume names the damaged file and continues from the step's own checkpoint."""
    first = run_fit(
        tmp_path / "a", "--batch-sizes", "8", "8", "--max-steps", "4", "--checkpoint-every", "4", "--save-last"
    )
    assert first.returncode == 0, first.output[-3000:]
    directory = tmp_path / "a" / "ckpt"
    damaged = directory / "last.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt"
    content = bytearray(damaged.read_bytes())
    content[len(content) // 2] ^= 0xFF
    damaged.write_bytes(bytes(content))
    resumed = run_fit(
        tmp_path / "b",
        "--batch-sizes",
        "8",
        "8",
        "--max-steps",
        "6",
        "--max-epochs",
        "2",
        "--checkpoint-every",
        "100",
        "--checkpoint-dir",
        str(directory),
        "--ckpt-path",
        "last",
        warnings=True,
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "checkpoint/mp_rank_00_model_states.pt does not match its checksum" in resumed.output
    assert f"Resuming from {directory / 'epoch=0-step=4.ckpt'}" in resumed.output
    assert resumed.result["global_step"] == 6


def test_a_last_checkpoint_that_lost_its_manifest_is_skipped_exactly_or_refused_on_every_rank(tmp_path):
    """Issue 51's run: a 2-rank fit (micro-batches 3/13, shuffled) saves every 3 steps; the newest checkpoint,
    last.ckpt, loses its hetero_manifest.json and `ckpt_path="last"` resumes. It was taken for a DeepSpeedStrategy
    checkpoint and resumed with that format's data position, samples of the epoch never trained. With older
    checkpoints beside it, it is skipped with a warning and the fit ends with the uninterrupted run's parameters, each
    sample once per epoch; as the only checkpoint it is refused on every rank."""
    common = ["--samples", "64", "--shuffle", "--batch-sizes", "3", "13", "--record-steps"]
    first = run_fit(tmp_path / "a", *common, "--max-steps", "6", "--checkpoint-every", "3", "--save-last")
    assert first.returncode == 0, first.output[-3000:]
    directory = tmp_path / "a" / "ckpt"
    (directory / "last.ckpt" / checkpoint.MANIFEST_NAME).unlink()
    resume = [
        *common,
        "--max-epochs",
        "2",
        "--checkpoint-every",
        "100",
        "--checkpoint-dir",
        str(directory),
        "--ckpt-path",
        "last",
    ]
    resumed = run_fit(tmp_path / "b", *resume, warnings=True)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"skipping checkpoint {directory / 'last.ckpt'}: it has no {checkpoint.MANIFEST_NAME}" in resumed.output
    assert f"Resuming from {directory / 'epoch=0-step=3.ckpt'}" in resumed.output  # (the one before last)
    assert resumed.result["global_step"] == 8
    dataset = IndexedRegression(64)
    orders = [list(RandomSampler(dataset, generator=torch.Generator().manual_seed(7 + epoch))) for epoch in (0, 1)]
    records = [json.loads(line) for line in (tmp_path / "b" / "steps.jsonl").read_text().splitlines()]
    for epoch, expected in ((0, orders[0][48:]), (1, orders[1])):  # the rest of epoch 0, then epoch 1: each once
        assert sorted(i for r in records if r["epoch"] == epoch for i in r["indices"]) == sorted(expected)
    steps = [order[begin : begin + 16] for order in orders for begin in range(0, 64, 16)]
    assert max_param_difference(resumed.result, reference_training(dataset, steps)) <= TOLERANCE
    for older in directory.glob("epoch=*.ckpt"):
        shutil.rmtree(older)
    refused = run_fit(tmp_path / "c", *resume)
    assert refused.returncode != 0
    reason = f"last.ckpt, which cannot be resumed from: it has no {checkpoint.MANIFEST_NAME}"
    assert refused.output.count(reason) >= 2, refused.output[-3000:]  # (rank 0's refusal, and rank 1's naming it)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_ddp_checkpoint_file_continues_under_hetero_as_the_uninterrupted_run(stage, tmp_path):
    """A user switching from strategy="ddp" mid-epoch: DDP trains 3 steps (Adam, shuffled, 2 ranks x 8) and saves a
    .ckpt file; HeteroStrategy (micro-batches 5/11, the same global batch of 16) continues from it: the weights, Adam's
    moments, the loops and the data position carry over, and two epochs end with the parameters one process reaches
    on the same global batches (it raised "it is a file, not a DeepSpeed checkpoint directory")."""
    common = ["--samples", "96", "--shuffle", "--optimizer", "adam", "--record-steps"]
    ddp = run_fit(tmp_path / "ddp", *common, "--ddp", "--max-steps", "3", "--checkpoint-every", "3")
    assert ddp.returncode == 0, ddp.output[-3000:]
    (saved,) = (tmp_path / "ddp" / "ckpt").iterdir()
    assert saved.is_file()
    resumed = run_fit(
        tmp_path / "hetero",
        *common,
        "--stage",
        str(stage),
        "--batch-sizes",
        "5",
        "11",
        "--max-epochs",
        "2",
        "--ckpt-path",
        str(saved),
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"continuing from {saved}, a Lightning checkpoint file" in resumed.output
    assert resumed.result["global_step"] == 12
    dataset = IndexedRegression(96)
    orders = [list(RandomSampler(dataset, generator=torch.Generator().manual_seed(7 + epoch))) for epoch in (0, 1)]
    steps = [order[begin : begin + 16] for order in orders for begin in range(0, 96, 16)]
    records = [json.loads(line) for line in (tmp_path / "hetero" / "steps.jsonl").read_text().splitlines()]
    assert sorted(i for r in records if r["epoch"] == 0 for i in r["indices"]) == sorted(orders[0][48:])
    difference = max_param_difference(resumed.result, reference_training(dataset, steps, optimizer_name="adam"))
    print(f"ZeRO-{stage}: largest parameter difference from the uninterrupted run: {difference:.1e}")
    assert difference <= TOLERANCE


@pytest.mark.fault
def test_an_elastic_job_of_two_torchrun_agents_loses_one_and_finishes_on_the_other(tmp_path):
    """The README's elastic command as written, on one machine: two torchrun agents (c10d rendezvous on 127.0.0.1, 2
    ranks each, nodes 1:2) train examples/fault_tolerant.py on 4 ranks; once a checkpoint is published, the second
    agent and its workers are killed (a node lost). The first agent's workers stop, it re-rendezvouses alone, and the
    job resumes on 2 ranks from the 4-rank checkpoint and finishes (at the default stage, ZeRO-0 here, each rank's file
    holds the whole state; a ZeRO-2 job goes through the universal format: the SGD test below). The
    example used to fail at once: "You set devices=2 and num_nodes=1 ... does not match the world size (4)"."""
    root = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--monitor-interval=0.5",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=elastic-test",
        "--rdzv-conf=last_call_timeout=5",
        str(REPO / "examples" / "fault_tolerant.py"),
        "--root",
        str(root),
        "--train-samples",
        "1536",
        "--epochs",
        "4",
        "--every",
        "3",
    ]
    environment = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    agents = []
    try:
        for _ in range(2):  # the first hosts the rendezvous store; each agent is a node, in a session of its own
            agents.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                    env=environment,
                )
            )
            time.sleep(1.0)
        deadline = time.monotonic() + 240
        while checkpoint.incompleteness(root / "checkpoints" / "last.ckpt") is not None:
            assert all(agent.poll() is None for agent in agents), agents[0].communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no checkpoint was published"
            time.sleep(0.2)
        assert checkpoint.read_manifest(root / "checkpoints" / "last.ckpt")["world_size"] == 4
        kill_tree(agents[1].pid)  # the node is lost: its agent and its workers
        output, _ = agents[0].communicate(timeout=240)
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    assert agents[0].returncode == 0, output[-4000:]
    assert "was saved by 4 ranks; this job has 2" in output, output[-4000:]
    assert "finished at step 24" in output, output[-4000:]
    assert checkpoint.read_manifest(root / "checkpoints" / "last.ckpt")["world_size"] == 2


@pytest.mark.fault
def test_an_elastic_sgd_job_at_zero_2_loses_an_agent_and_finishes_on_the_other_as_the_uninterrupted_run(tmp_path):
    """Issue 29: two torchrun agents of 1 rank each (c10d rendezvous, nodes 1:2) train SGD with momentum at ZeRO-2
    (global batch 16, a checkpoint every 5 steps); once the checkpoint of step 5 is published, while the ranks wait at
    step 5, the second agent and its worker are killed (a node lost). The survivor re-rendezvouses alone, resumes the
    2-rank checkpoint on 1 rank (its momentum cut per parameter and put together again) and ends 4 epochs with the
    parameters of one process trained on the same global batches. It used to be refused ("resume on the original
    number of ranks") on every restart until torchrun gave up."""
    out, go_on = tmp_path / "run", tmp_path / "go_on"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--monitor-interval=0.5",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=elastic-sgd",
        "--rdzv-conf=last_call_timeout=5",
        str(WORKERS / "fit.py"),
        "--out",
        str(out),
        "--launched-layout",
        "--global-batch-size",
        "16",
        "--samples",
        "160",
        "--max-epochs",
        "4",
        "--checkpoint-every",
        "5",
        "--save-last",
        "--ckpt-path",
        "last",
        "--optimizer",
        "sgd",
        "--stage",
        "2",
        "--hold-at",
        f"5:{go_on}",
    ]
    environment = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    agents = []
    try:
        for _ in range(2):  # the first hosts the rendezvous store; each agent is a node, in a session of its own
            agents.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                    env=environment,
                )
            )
            time.sleep(1.0)
        last = out / "ckpt" / "last.ckpt"
        deadline = time.monotonic() + 240
        while checkpoint.incompleteness(last) is not None:
            assert all(agent.poll() is None for agent in agents), agents[0].communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no checkpoint was published"
            time.sleep(0.2)
        assert checkpoint.read_manifest(last)["world_size"] == 2
        kill_tree(agents[1].pid)  # the node is lost: its agent and its worker
        go_on.touch()
        output, _ = agents[0].communicate(timeout=240)
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    assert agents[0].returncode == 0, output[-4000:]
    converted = f"{last} was saved by 2 ranks; this job has 1: converted to DeepSpeed's universal format"
    assert converted in output, output[-4000:]
    result = json.loads((out / "result.json").read_text())
    assert result["global_step"] == 40 and len(result["seen"]) == 1
    reference = reference_training(IndexedRegression(160), contiguous_steps(160, 16) * 4, optimizer_name="sgd")
    difference = max_param_difference(result, reference)
    print(f"2 agents -> 1: largest parameter difference from the uninterrupted run {difference:.1e}")
    assert difference <= TOLERANCE, difference
    assert checkpoint.read_manifest(last)["world_size"] == 1
