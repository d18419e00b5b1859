"""Memory-sized optimizer shards in data-parallel training, end to end: CPU ranks (gloo) with emulated device memory.

The claims under test: with `stage=1 or 2, shards="memory"` the update equals one process on the global batch (SGD
with momentum, Adam, AdamW, gradient clipping, micro-steps with Lightning's accumulation, steps skipped on every
rank for one rank's NaN), each parameter's optimizer state is on exactly one rank and the small device holds the small
share, a model whose state does not fit the small device at DeepSpeed's even ZeRO-2 shards is refused there and trains
with memory-sized shards, and a checkpoint resumes on another number of ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parents[1]))

from common import IndexedRegression, max_param_difference, reference_training  # noqa: E402
from conftest import run_fit  # noqa: E402
from test_strategy_multiprocess import contiguous_steps, rank_slices  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
HIDDEN, DEPTH = 32, 2  # 1,249 parameters in 6 tensors (4 -> 32 -> 32 -> 1)
# Rank 0's device holds 64 KiB, rank 1's 27 KiB. Without a profile, half of each room is kept for activations: at
# even ZeRO-2 shards rank 1 needs 10 bytes per parameter (12.2 KiB) of its 10.8 KiB, while its room after the model
# and its gradients (8 bytes per parameter) holds a 5 % share of the optimizer state.
MEMORY = {"LIGHTNING_HETERO_EMULATE_MEMORY": "64KiB,27KiB"}
COMMON = ["--hidden", str(HIDDEN), "--depth", str(DEPTH), "--batch-sizes", "6", "2", "--samples", "48"]
SHARES = [6, 2]
CASES = {  # optimizer, clipping (chosen to clip: the first steps' norms are about 0.3)
    "sgd": ("sgd", None),
    "adam": ("adam", 0.05),
    "adamw": ("adamw", None),
    "accumulated": ("sgd", None),  # rank 0 in micro-steps of 3, and Lightning's accumulate_grad_batches=2
    "skipped": ("sgd", None),  # rank 1's loss NaN at steps 2 and 3: every rank skips them (the agreed norm)
}
SKIPPED = [2, 3]


def shards_args(stage: int) -> list[str]:
    return ["--stage", str(stage), "--strategy-args", json.dumps({"shards": "memory"})]


def reference(steps, optimizer: str, clip, accumulate: int = 1) -> dict:
    return reference_training(
        IndexedRegression(48),
        steps,
        optimizer_name=optimizer,
        hidden=HIDDEN,
        depth=DEPTH,
        clip=clip or 0.0,
        accumulate=accumulate,
    )


def assert_each_state_on_one_rank(result: dict, world_size: int) -> list[set]:
    held = [set(names) for names in result["optimizer_state_names"]]
    assert len(held) == world_size
    everything = set(result["params"])
    assert set().union(*held) == everything, held  # every parameter's state is somewhere...
    assert sum(len(names) for names in held) == len(everything), held  # ...on one rank only
    return held


def elements(result: dict, names: set) -> int:
    return sum(torch.tensor(result["params"][name]).numel() for name in names)


def test_memory_shards_train_as_one_process_where_even_zero_2_shards_do_not_fit(tmp_path):
    steps = contiguous_steps(48, 8, 6)
    each = []
    for case, (optimizer, clip) in CASES.items():
        stage = "1" if case == "adamw" else "2"
        more = ["--out", str(tmp_path / case), "--optimizer", optimizer, "--stage", stage]
        if case == "skipped":
            shards = json.dumps({"shards": "memory", "max_nonfinite_steps": None})
            more += ["--nan-from", "1:2", "--nan-until", "4", "--strategy-args", shards]
        if case == "accumulated":
            shards = json.dumps({"shards": "memory", "micro_steps": [3, 1]})  # (micro-batches of 2: shares 6 and 2)
            more += ["--accumulate", "2", "--batch-sizes", "2", "2", "--strategy-args", shards]
        each.append(more + (["--clip", str(clip)] if clip else []))
    run = run_fit(
        tmp_path,
        *COMMON,
        "--strategy-args",
        json.dumps({"shards": "memory"}),
        "--each",
        json.dumps(each),
        env=MEMORY,
        timeout=300,
    )
    assert run.returncode == 0, run.output[-4000:]
    assert "sharded by memory (in proportion to the memory left after activations): rank 0 95 %, rank 1 5 %" in (
        run.output
    )
    for case, (optimizer, clip) in CASES.items():
        result = json.loads((tmp_path / case / "result.json").read_text())
        assert result["seen"] == rank_slices(steps, SHARES)
        accumulate = 2 if case == "accumulated" else 1
        trained = [step for index, step in enumerate(steps) if case != "skipped" or index not in SKIPPED]
        difference = max_param_difference(result, reference(trained, optimizer, clip, accumulate))
        print(f"{case}: {difference:.3g} off one process")
        assert difference <= TOLERANCE, case
        held = assert_each_state_on_one_rank(result, 2)
        assert 0 < elements(result, held[1]) < 0.1 * elements(result, held[0])  # the small device's share is small
    report = json.loads(next((tmp_path / "skipped").rglob("hetero/report.json")).read_text())
    assert report["nonfinite"]["skipped_steps"] == SKIPPED
    # The same model at DeepSpeed's even ZeRO-2 shards, on the same emulated devices: refused before training.
    even = run_fit(tmp_path / "even", *COMMON, "--stage", "2", env=MEMORY)
    assert even.returncode != 0
    assert "HeteroStrategy(stage=2): at ZeRO stage 2 rank 1 would need 12.2 KiB of its 10.8 KiB" in even.output
    assert "with the device memory LIGHTNING_HETERO_EMULATE_MEMORY gives (64.0 KiB, 27.0 KiB)" in even.output
    assert "shard the optimizer state by memory (`stage=1` or `2`, `shards='memory'`)" in even.output


@pytest.mark.fault
def test_a_memory_sharded_checkpoint_resumes_on_another_number_of_ranks_and_without_shards(tmp_path):
    """2 ranks (6 + 2) train Adam with memory-sized shards and save at step 2 (`trainer.save_checkpoint` after the fit
    writes every rank's share too); 3 ranks (4 + 2 + 2, other memories) resume with shards, and 1 rank resumes at
    ZeRO-0 without them: both end the epoch at one process's parameters."""
    steps = contiguous_steps(48, 8, 6)
    first = run_fit(
        tmp_path / "two",
        *COMMON,
        *shards_args(2),
        "--optimizer",
        "adam",
        "--max-steps",
        "2",
        "--checkpoint-every",
        "2",
        "--save-after-fit",
        str(tmp_path / "after_fit.ckpt"),
        env=MEMORY,
    )
    assert first.returncode == 0, first.output[-4000:]
    (checkpoint,) = (tmp_path / "two" / "ckpt").iterdir()
    assert sorted(p.name for p in checkpoint.glob("optimizer_shard_rank*.pt")) == [
        "optimizer_shard_rank0.pt",
        "optimizer_shard_rank1.pt",
    ]
    # `trainer.save_checkpoint` after the fit holds every rank's share too, the same as the fit's own save at step 2.
    after_fit = tmp_path / "after_fit.ckpt"
    for rank in (0, 1):
        saved = torch.load(checkpoint / f"optimizer_shard_rank{rank}.pt", weights_only=True)["optimizer"]["state"]
        again = torch.load(after_fit / f"optimizer_shard_rank{rank}.pt", weights_only=True)["optimizer"]["state"]
        assert saved.keys() == again.keys() and saved
        assert all(torch.equal(saved[n]["exp_avg"], again[n]["exp_avg"]) for n in saved)
    expected = reference(steps, "adam", None)
    three = run_fit(
        tmp_path / "three",
        *COMMON[:4],
        "--samples",
        "48",
        "--batch-sizes",
        "4",
        "2",
        "2",
        "--devices",
        "3",
        *shards_args(1),
        "--optimizer",
        "adam",
        "--ckpt-path",
        str(checkpoint),
        env={"LIGHTNING_HETERO_EMULATE_MEMORY": "27KiB,64KiB,40KiB"},
    )
    assert three.returncode == 0, three.output[-4000:]
    assert three.result["seen"] == rank_slices(steps[2:], [4, 2, 2])
    assert max_param_difference(three.result, expected) <= TOLERANCE
    held = assert_each_state_on_one_rank(three.result, 3)
    assert elements(three.result, held[1]) > max(elements(three.result, held[0]), elements(three.result, held[2]))
    one = run_fit(
        tmp_path / "one",
        *COMMON[:4],
        "--samples",
        "48",
        "--batch-sizes",
        "8",
        "--devices",
        "1",
        "--stage",
        "0",
        "--optimizer",
        "adam",
        "--ckpt-path",
        str(checkpoint),
    )
    assert one.returncode == 0, one.output[-4000:]
    assert max_param_difference(one.result, expected) <= TOLERANCE
    assert set(one.result["optimizer_state_names"][0]) == set(one.result["params"])
    refused = run_fit(
        tmp_path / "zero2", *COMMON, "--stage", "2", "--optimizer", "adam", "--ckpt-path", str(checkpoint)
    )
    assert refused.returncode != 0
    assert "was saved with memory-sized optimizer shards (`shards='memory'`)" in refused.output


@pytest.mark.fault
def test_a_split_taken_from_a_checkpoint_moves_the_shares_inside_a_fit_and_stays_one_process(tmp_path):
    """The automatic split (activations measured, so each rank's room follows its samples), 1,500 KiB of emulated
    memory each. Rank 1 at a fifth of rank 0's speed takes few samples and saves at step 2; the resume has the speeds
    the other way round, plans the opposite split and shares, then takes up the checkpoint's split before its first
    batch: the shares move inside the fit (the split's follower, not a stand-in), and the epoch ends at one process's
    parameters (SGD with momentum)."""
    common = ["--hidden", "128", "--depth", "6", "--samples", "320", "--global-batch-size", "64", "--stage", "2"]
    common += ["--strategy-args", json.dumps({"shards": "memory"})]
    memory = {"LIGHTNING_HETERO_EMULATE_MEMORY": "1500KiB,1500KiB"}
    first = run_fit(
        tmp_path / "first",
        *common,
        "--emulate-speeds",
        "1.0",
        "0.2",
        "--max-steps",
        "2",
        "--checkpoint-every",
        "2",
        env=memory,
    )
    assert first.returncode == 0, first.output[-4000:]
    split = json.loads((tmp_path / "first" / "hetero" / "plan.json").read_text())["batch_sizes"]
    assert split[0] > split[1], split
    (checkpoint,) = (tmp_path / "first" / "ckpt").iterdir()
    resumed = run_fit(
        tmp_path / "resumed", *common, "--emulate-speeds", "0.2", "1.0", "--ckpt-path", str(checkpoint), env=memory
    )
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"resumes with the checkpoint's micro-batches {split}" in resumed.output
    assert "HeteroStrategy re-plan: the optimizer state's shards move, " in resumed.output
    steps = contiguous_steps(320, 64, 5)
    expected = reference_training(IndexedRegression(320), steps, hidden=128, depth=6)
    assert max_param_difference(resumed.result, expected) <= TOLERANCE
    assert_each_state_on_one_rank(resumed.result, 2)
