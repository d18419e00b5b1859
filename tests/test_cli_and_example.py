"""The README's commands: the example job and the `lightning-hetero` CLI with both YAML forms (real 2-rank runs)."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
from conftest import REPO, run_bounded

from lightning_hetero.split.decisions.planner import MIN_PREDICTED_GAIN

pytestmark = pytest.mark.multiprocess


def plan_rows(output: str) -> list[tuple[int, int]]:
    """(rank, micro-batch) rows of the plan table printed by rank 0 (rank, device, precision, micro-batch, ...)."""
    rows = re.findall(r"^(\d+)\s+cpu: [^\n]*?\)\s+[\w-]+\s+(\d+)\s", output, re.M)
    return [(int(rank), int(micro)) for rank, micro in rows]


@pytest.mark.parametrize(
    ("config", "expected_rows", "extra"),
    # The string form plans automatically: equal on identical ranks unless a profile predicts a 25 % gain, which
    # timing noise on a shared machine can (rarely); the weighted form's split is exact, also in micro-steps (the
    # table's first number is then each rank's samples).
    [
        ("configs/spirals.yaml", None, []),
        ("configs/spirals_weighted.yaml", [(0, 91), (1, 37)], []),
        ("configs/spirals_weighted.yaml", [(0, 91), (1, 37)], ["--trainer.strategy.init_args.micro_steps=[2, 1]"]),
    ],
)
def test_cli_fits_with_string_and_class_path_strategy(config, expected_rows, extra, tmp_path):
    executable = shutil.which("lightning-hetero")
    assert executable, "the console script is missing: install the package with `pip install -e .`"
    returncode, output = run_bounded(
        [
            executable,
            "fit",
            "--config",
            config,
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=2",
            f"--trainer.default_root_dir={tmp_path}",
            *extra,
        ],
        timeout=180,
    )
    assert returncode == 0, output[-4000:]
    rows = plan_rows(output)
    assert [rank for rank, _ in rows] == [0, 1] and sum(micro for _, micro in rows) == 128
    if expected_rows is not None:
        assert rows == expected_rows
    (plan,) = tmp_path.rglob("plan.json")
    assert json.loads(plan.read_text())["micro_steps"] == ([2, 1] if extra else [1, 1])
    assert sorted(p.name for p in tmp_path.rglob("rank_*.json")) == ["rank_0.json", "rank_1.json"]


def test_cli_fits_a_pipeline_from_the_yaml(tmp_path):
    """`pipeline` as init_args: the plan names each stage's rank and blocks, the run report each stage's times."""
    executable = shutil.which("lightning-hetero")
    assert executable, "the console script is missing: install the package with `pip install -e .`"
    returncode, output = run_bounded(
        [
            executable,
            "fit",
            "--config",
            "configs/spirals_pipeline.yaml",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=4",
            "--trainer.limit_val_batches=2",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        timeout=180,
    )
    assert returncode == 0, output[-4000:]
    stages = re.findall(r"^  stage (\d) on rank (\d): blocks (\d+)\.\.(\d+) \((\d+)\)", output, re.M)
    assert [s[0] for s in stages] == ["0", "1"] and stages[1][1] == "0"  # rank 0 runs the last stage
    assert sum(int(s[4]) for s in stages) == 12
    (report,) = tmp_path.rglob("pipeline_report.json")
    assert [stage["stage"] for stage in json.loads(report.read_text())["stages"]] == [0, 1]


def test_cli_fits_with_diloco_from_the_command_line(tmp_path):
    """Local training from the CLI: the class_path form with `sync`, `sync_every` and `inner_steps` as init_args."""
    executable = shutil.which("lightning-hetero")
    assert executable, "the console script is missing: install the package with `pip install -e .`"
    returncode, output = run_bounded(
        [
            executable,
            "fit",
            "--config",
            "configs/spirals.yaml",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=4",
            "--trainer.limit_val_batches=2",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.strategy=lightning_hetero.HeteroStrategy",
            "--trainer.strategy.init_args.sync=diloco",
            "--trainer.strategy.init_args.sync_every=2",
            "--trainer.strategy.init_args.inner_steps=[2, 1]",
        ],
        timeout=180,
    )
    assert returncode == 0, output[-4000:]
    (plan,) = tmp_path.rglob("plan.json")
    recorded = json.loads(plan.read_text())
    assert (recorded["source"], recorded["micro_steps"], recorded["batch_sizes"]) == ("diloco", [2, 1], [128, 64])
    assert "diloco: each rank trains on its own, inner steps per training step [2, 1]; every 2 training steps" in output


# Third-party lines that each rank printed on every run and that no user can act on (see runtime/quiet.py).
NOISE = [
    "Setting accelerator to CPU",
    "deepspeed_shm_comm_op built successfully",
    "You are using ZeRO with an untested optimizer",
    "all_gather_into_tensor` is deprecated",
    "isinstance(treespec, LeafSpec)` is deprecated",
    "Tip: For seamless",
    "initializing deepspeed distributed",
]


def test_the_llm_example_places_a_gpt2_pipeline_by_speed_and_learns():
    """examples/finetune_llm.py, short: its placement gives the rank emulated at 0.5 fewer of the 6 blocks, the loss
    falls, and its output is the placement, the loss lines and the result (skipped without the `llm` extra)."""
    pytest.importorskip("transformers", reason='the example needs transformers: pip install -e ".[llm]"')
    returncode, output = run_bounded(
        [sys.executable, "examples/finetune_llm.py", "--steps", "16", "--no-baseline"],
        timeout=300,
        cwd=REPO,
        env={"PYTHONWARNINGS": "default"},
    )
    assert returncode == 0, output[-4000:]
    assert [line for line in NOISE if line in output] == [], output[-4000:]
    assert "[transformers]" not in output and "Warning" not in output, output
    stages = dict(re.findall(r"^  stage (\d) on rank \d: blocks \S+ \((\d)\)", output, re.M))
    assert int(stages["1"]) > int(stages["0"]), output  # (stage 0 runs on rank 1, the slower)
    losses = [float(loss) for loss in re.findall(r"^  steps +\d+- *\d+  loss ([\d.]+)", output, re.M)]
    first, last = map(float, re.search(r"^placed by speed: loss ([\d.]+) -> ([\d.]+)", output, re.M).groups())
    assert len(losses) == 8 and (first, last) == (losses[0], losses[-1]) and last < first, output


def test_example_learns_and_compares_with_the_equal_split(tmp_path):
    returncode, output = run_bounded(
        [sys.executable, "examples/train_spirals.py", "--epochs", "2", "--root", str(tmp_path)],
        timeout=300,
        cwd=REPO,
        env={"PYTHONWARNINGS": "default"},  # as a user runs it: every warning shown
    )
    assert returncode == 0, output[-4000:]
    # Output for a person: the plans, one progress line per epoch, the run reports, the result; none of the
    # third-party noise.
    assert [line for line in NOISE if line in output] == [], output[-4000:]
    assert len(output.splitlines()) <= 44, output  # one screen
    assert len(re.findall(r"^  epoch \d/2: val loss [\d.]+, val acc [\d.]+%", output, re.M)) == 4
    summaries = re.findall(r"^HeteroStrategy run report: \d+ steps, \d+ samples/s, balance efficiency", output, re.M)
    assert len(summaries) == 2
    # Two plan tables: the automatic split (rank 1 emulated at speed 0.4), then the equal-split baseline.
    (_, fast), (_, slow), baseline_0, baseline_1 = plan_rows(output)
    assert fast + slow == 256 and fast > 1.5 * slow
    assert (baseline_0, baseline_1) == ((0, 128), (1, 128))
    assert re.search(r"predicted compute per step: [\d.]+ ms with this split, [\d.]+ ms with an equal split", output)
    # The result table shows the split in use at the end: the plan's, or the last re-plan's (re-planning is on for
    # the automatic split, and a 2-epoch run on a shared machine may re-plan).
    report = json.loads((tmp_path / "lightning_logs" / "version_0" / "hetero" / "report.json").read_text())
    assert report["steps"][0]["batch_sizes"] == [fast, slow]
    final = report["replans"][-1]["batch_sizes"] if report["replans"] else [fast, slow]
    full_batches = [step["batch_sizes"] for step in report["steps"] if sum(step["batch_sizes"]) == 256]
    assert full_batches[-1] == final  # (an epoch's last global batch is short, split in the same proportion)
    rows = dict(re.findall(r"^(hetero|equal \(DDP\)) +(\d+/\d+) ", output, re.M))
    assert rows == {"hetero": "/".join(map(str, final)), "equal (DDP)": "128/128"}, output[-2000:]
    speedup = r"^measured speedup over the equal split: [\d.]+x \(the slowest rank's compute per step: [\d.]+x less\)$"
    assert re.search(speedup, output, re.M), output[-2000:]
    assert re.search(r"^profiling cost: [\d.]+ s once per fit = [\d.]+% of a 500-step run", output, re.M)
    before, after = map(float, re.search(r"validation accuracy ([\d.]+)% -> ([\d.]+)%", output).groups())
    loss_before, loss_after = map(float, re.search(r"validation loss +([\d.]+) -> ([\d.]+)", output).groups())
    assert after > before + 15 and loss_after < loss_before / 2  # two epochs only: clearly learning


def test_example_splits_by_measured_precision_without_emulation(tmp_path):
    """bf16 beside fp32 on one CPU: real heterogeneity, found by the profiler (no speed emulation)."""
    from lightning_hetero.measure.devices import collect_device_facts

    returncode, output = run_bounded(
        [
            sys.executable,
            "examples/train_spirals.py",
            "--epochs",
            "1",
            "--no-baseline",
            "--device-precision",
            "bf16-mixed",
            "32-true",
            "--root",
            str(tmp_path),
        ],
        timeout=300,
        cwd=REPO,
    )
    assert returncode == 0, output[-4000:]
    rows = re.findall(r"^(\d)\s+cpu: [^\n]*?\)\s+(bf16-mixed|32-true)\s+(\d+)\s", output, re.M)
    assert [(rank, precision) for rank, precision, _ in rows] == [("0", "bf16-mixed"), ("1", "32-true")]
    bf16_batch, fp32_batch = (int(batch) for _, _, batch in rows)
    assert bf16_batch + fp32_batch == 256
    plan = json.loads((tmp_path / "lightning_logs" / "version_0" / "hetero" / "plan.json").read_text())
    assert plan["emulate_speeds"] is None and plan["precisions"] == ["bf16-mixed", "32-true"]
    # Each rank was profiled in its own precision, and the rank that computes the equal share faster gets more. (On
    # AVX512-BF16 or AMX bf16 usually measures faster, but a small model on a shared machine can measure either way:
    # seen once in a full suite run here, so the claim is the following, not the hardware's.)
    bf16_cost, fp32_cost = (p["fixed_seconds"] + 128 * p["seconds_per_sample"] for p in plan["profiles"])
    if plan["source"].startswith("auto: equal"):
        # A predicted gain below MIN_PREDICTED_GAIN keeps the equal split (seen once in a full suite: 9.5 against
        # 10.1 ms of compute); the plan says so, and the prediction it kept is the equal split's.
        assert bf16_batch == fp32_batch and f"< {MIN_PREDICTED_GAIN:.0%}" in plan["source"], output[-3000:]
        assert plan["prediction"]["speedup"] == 1.0
    else:
        assert (bf16_batch > fp32_batch) == (bf16_cost < fp32_cost), output[-3000:]
    print(
        f"equal-share compute: bf16 {bf16_cost * 1e3:.2f} ms, fp32 {fp32_cost * 1e3:.2f} ms"
        f" (bf16 native: {collect_device_facts('cpu').bf16_native})"
    )
