"""`lightning-hetero plan` end to end, in this process: the examples' model measured here, a cluster file, the
documented JSON, the what-ifs, and bad input refused with exit code 2 and the message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_hetero import cli

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--model", "examples.spirals:SpiralClassifier", "--data", "examples.spirals:SpiralDataModule"]
CLUSTER = (ROOT / "configs" / "cluster_example.yaml").read_text()


@pytest.fixture
def cluster_file(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # `examples.spirals` is found from the working directory, as `python -m` would
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return str(path)


def run(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", *args])
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_json_has_the_documented_keys_and_one_entry_per_device_and_the_what_ifs(cluster_file, capsys):
    code, out, _ = run(
        [
            "--cluster",
            cluster_file,
            *MODEL,
            "--json",
            "--drop",
            "V100-32GB",
            "--add",
            "H100:2",
            "--stage",
            "0",
            "--global-batch-size",
            "600",
        ],
        capsys,
    )
    assert code == 0
    result = json.loads(out)
    assert len(result["devices"]) == 9
    for device in result["devices"]:
        assert {"kind", "node", "micro_batch", "micro_steps", "precision", "memory_bytes", "compute_ms"} <= set(device)
    assert sum(d["samples"] for d in result["devices"]) == 600
    assert {d["precision"] for d in result["devices"]} == {"bf16-mixed", "16-mixed", "32-true"}
    assert set(result["step_ms"]) == {"total", "compute", "exchange", "optimizer", "overhead"}
    assert result["step_ms"]["overhead"] == 0.0  # no --calibrate
    assert result["speedup_over_equal"] >= 1.0
    # No --stage: the lowest that fits, as HeteroStrategy chooses (this small model fits everywhere at ZeRO-0).
    assert result["settings"]["zero_stage"] == 0
    assert result["settings"]["zero_stage_reason"].startswith("ZeRO stage 0 (auto): the model, its gradients")
    what_if = result["what_if"]
    assert [d["kind"] for d in what_if["devices"]] == ["A100-80GB"] * 4 + ["cpu-32c-avx512"] + ["H100"] * 2
    assert [d["node"] for d in what_if["devices"]] == [0] * 4 + [1] + [2] * 2
    assert what_if["settings"]["zero_stage"] == 0 and what_if["settings"]["nodes"] == 3


def test_the_tables_show_the_plan_the_step_and_the_speedups(cluster_file, capsys):
    code, out, _ = run(["--cluster", cluster_file, *MODEL], capsys)
    assert code == 0
    for expected in (
        "A100-80GB",
        "V100-32GB",
        "micro-steps",
        "step:",
        "equal split (DDP)",
        "best homogeneous subset",
        "on the wire",
    ):
        assert expected in out
    assert "what if" not in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--drop", "T4"], "`--drop T4`: the cluster has no device of that kind"),
        (["--add", "H100"], "`--add H100` must be KIND:N"),
        (["--add", "H10:2"], "unknown device kind 'H10'; the closest known kinds: 'H100'"),
        (["--compression", "topk", "--stage", "2"], "`compression='topk'` needs `stage=0`"),
        (["--init-args", "{hidden: 3}"], "`--init-args {hidden: 3}` is not JSON"),
        (["--init-args", "[3]"], "`--init-args [3]` must be a JSON object"),
        (["--init-args", '{"width": 3}'], 'with `--init-args {"width": 3}`: '),
        (["--global-batch-size", "4"], "`global_batch_size=4` is smaller than the world size 9"),
        (["--compression", "int8"], "int8 and int4 quantize the pseudo-gradient of a merge"),
        (["--sync-options", '{"fragments": 2}'], "`--sync-every`, `--sync-options` and `--inner-steps` plan local"),
        (["--sync-every", "16"], "`--sync-every`, `--sync-options` and `--inner-steps` plan local training"),
        (["--sync", "diloco", "--sync-options", "4"], "`--sync-options 4` must be a JSON object"),
        (["--sync", "diloco"], "with an fp16 rank"),  # (the V100s train in fp16 by default)
        (["--sync", "diloco", "--precision", "32-true", "--stage", "2"], "`sync='diloco'` needs `stage=0`"),
        (
            ["--sync", "diloco", "--precision", "32-true", "--sync-options", "{fragments: 2}"],
            "`--sync-options {fragments: 2}` is not JSON",
        ),
        (
            ["--sync", "diloco", "--precision", "32-true", "--sync-options", '{"fragments": 3}'],
            "that divides `sync_every=8`",
        ),
        (
            ["--sync", "diloco", "--precision", "32-true", "--compression", "powersgd"],
            "travels in fp32, fp16, bf16, int8 or int4 only",
        ),
        (
            ["--sync", "diloco", "--precision", "32-true", "--sync-options", '{"asynchronous": true}'],
            "`--sync-options` with `asynchronous`: `plan` predicts merges whose ranks take",
        ),
        (
            ["--sync", "diloco", "--precision", "32-true", "--inner-steps", "2", "1"],
            "`inner_steps=[2, 1]` has 2 entries",
        ),
        (
            ["--sync", "diloco", "--precision", "32-true", "--inner-steps", *"111111111", "--drop", "V100-32GB"],
            "`--inner-steps` with `--drop`/`--add`",
        ),
    ],
)
def test_bad_what_ifs_exit_2_with_the_fix(cluster_file, capsys, args, message):
    code, out, err = run(["--cluster", cluster_file, *MODEL, *args], capsys)
    assert code == 2 and message in err and not out


def test_local_training_is_planned_with_its_inner_steps_merges_on_the_link_overlap_and_int8(tmp_path, capsys):
    """Two GPUs (bf16 both) on two nodes over 1 Gbit/s: DiLoCo's merge of int8 pseudo-gradients in 4 fragments,
    overlapped, sends a quarter of the model at about a byte a value and waits less on the link than the merge in fp32
    that is waited for; both train more samples a second than every-step training over that link."""
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "nodes:\n  - {devices: [{kind: A100-80GB}]}\n  - {devices: [{kind: A10}]}\n"
        "inter_node: {bandwidth: 1Gbit, latency: 500us}\n"
    )
    base = ["--cluster", str(path), *MODEL, "--init-args", '{"hidden": 512}', "--global-batch-size", "128", "--json"]
    code, out, _ = run([*base, "--sync", "diloco"], capsys)
    assert code == 0
    waited = json.loads(out)
    code, out, _ = run(
        [*base, "--sync", "diloco", "--sync-options", '{"fragments": 4, "overlap": true}', "--compression", "int8"],
        capsys,
    )
    assert code == 0
    result = json.loads(out)
    local = result["local"]
    assert result["settings"]["compression"] is None  # (the every-step plan above it: uncompressed)
    assert (local["sync"], local["sync_every"], local["fragments"], local["overlap_steps"], local["compression"]) == (
        "diloco",
        8,
        4,
        1,
        "int8",
    )
    assert [d["micro_batch"] for d in local["devices"]] == [64, 64] and all(
        d["inner_steps"] >= 1 for d in local["devices"]
    )
    assert set(local["training_step_ms"]) == {"total", "compute", "link_wait", "overhead"}
    parameters = waited["local"]["merge"]["bytes_per_rank"] / 4
    assert local["merge"]["bytes_per_rank"] == pytest.approx(parameters / 4 * (1 + 4 / 256), rel=3e-3)  # (to a block)
    assert local["merge"]["every_steps"] == 2 and waited["local"]["merge"]["every_steps"] == 8
    assert local["link_wait_over_compute"] < waited["local"]["link_wait_over_compute"]
    assert waited["local"]["speedup_over_every_step"] > 1 and local["speedup_over_every_step"] > 1
    code, out, _ = run([arg for arg in base if arg != "--json"] + ["--sync", "local_sgd"], capsys)
    assert code == 0
    assert "with sync=local_sgd: a merge every 8 training steps, waited for, pseudo-gradients in fp32" in out
    assert "training step:" in out and "waiting on the link" in out and "than the every-step plan above" in out


def test_a_bad_cluster_file_exits_2_naming_the_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "bad.yaml"
    path.write_text("nodes:\n  - devices:\n      - {kind: A100-80gb, count: 2}\n      - {kind: V10-32GB}\n")
    code, _, err = run(["--cluster", str(path), *MODEL], capsys)
    assert code == 2 and f"{path}:4:" in err and "'V100-32GB'" in err


def test_ten_thousand_devices_are_planned(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    kinds = ["H100", "A100-80GB", "V100-32GB", "RTX-4090"]
    nodes = "\n".join(f"  - {{devices: [{{kind: {kinds[i % 4]}, count: 8}}]}}" for i in range(1250))
    path = tmp_path / "big.yaml"
    path.write_text(f"nodes:\n{nodes}\ninter_node: {{bandwidth: 100Gbit, latency: 5us}}\n")
    code, out, _ = run(["--cluster", str(path), *MODEL, "--json", "--global-batch-size", "100000"], capsys)
    result = json.loads(out)
    assert code == 0 and len(result["devices"]) == 10_000
    assert sum(d["samples"] for d in result["devices"]) == 100_000


def _write_run(directory: Path, device: dict, profile: dict, compute: float, step: float) -> None:
    directory.mkdir()
    for rank in range(2):
        rank_file = {
            "device": device,
            "precision": "32-true",
            "plan": {"global_batch_size": 256, "emulate_speeds": None},
            "profile": profile,
            "deepspeed_config": {"zero_optimization": {"stage": 0}},
        }
        (directory / f"rank_{rank}.json").write_text(json.dumps(rank_file))
    steps = [{"batch_sizes": [128, 128], "compute_seconds": [compute] * 2, "step_seconds": step}] * 25
    report = {"steps": steps, "communication": {"nodes": [0, 0], "emulated_link": None, "compression": None}}
    (directory / "report.json").write_text(json.dumps(report))


def test_a_cpu_run_calibrates_the_loop_and_a_gpu_run_the_efficiency_of_its_kind(tmp_path, capsys, monkeypatch):
    # GPUs only: the example cluster's 32-core CPU is predicted from this machine's measured step, and where this CPU
    # measures fast (a faster machine, a warm process) it takes all but one sample from every GPU, in both plans.
    monkeypatch.chdir(ROOT)
    cluster_file = tmp_path / "gpus.yaml"
    cluster_file.write_text(
        "nodes:\n  - {devices: [{kind: A100-80GB, count: 4}], link: 200Gbit}\n"
        "  - {devices: [{kind: V100-32GB, count: 4}], link: 200Gbit}\ninter_node: {bandwidth: 10Gbit, latency: 50us}\n"
    )
    cpu_run, gpu_run = tmp_path / "cpu_run", tmp_path / "gpu_run"
    _write_run(
        cpu_run, {"kind": "cpu", "name": "cpu"}, {"fixed_seconds": 1e-3, "seconds_per_sample": 5e-5}, 0.015, 0.03
    )
    a100 = {"kind": "cuda", "name": "NVIDIA A100-SXM4-80GB"}
    _write_run(gpu_run, a100, {"fixed_seconds": 1e-4, "seconds_per_sample": 1e-7}, 0.001, 0.002)
    code, out, _ = run(["--cluster", str(cluster_file), *MODEL, "--json"], capsys)
    plain = json.loads(out)
    code, out, _ = run(
        ["--cluster", str(cluster_file), *MODEL, "--json", "--calibrate", str(cpu_run), "--profile", str(gpu_run)],
        capsys,
    )
    assert code == 0
    calibrated = json.loads(out)
    assert calibrated["step_ms"]["overhead"] > 0 and plain["step_ms"]["overhead"] == 0
    a100_plain = next(d for d in plain["devices"] if d["kind"] == "A100-80GB")
    a100_calibrated = next(d for d in calibrated["devices"] if d["kind"] == "A100-80GB")
    # The run's profile (fp32, 1e-7 s per sample) puts the A100 at another fraction of its peak than the default
    # 40 %, so the plan gives it another share.
    assert a100_calibrated["samples"] != a100_plain["samples"]


@pytest.mark.parametrize("flag", ["--calibrate", "--profile"])
def test_a_run_directory_without_rank_files_exits_2(cluster_file, tmp_path, capsys, flag):
    code, _, err = run(["--cluster", cluster_file, *MODEL, flag, str(tmp_path)], capsys)
    assert code == 2 and f"`{flag} {tmp_path}` has no rank_<r>.json" in err


def test_a_pipeline_is_planned_beside_the_batch_split(tmp_path, capsys, monkeypatch):
    """`--pipeline-blocks`: the chain measured here, placed on the cluster's devices; the table and the JSON."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes:\n  - devices: [{kind: A100-80GB, count: 2}, {kind: V100-32GB, count: 2}]\n")
    chain = [
        "--model",
        "examples.spirals:SpiralChain",
        "--data",
        "examples.spirals:SpiralDataModule",
        "--pipeline-blocks",
        "blocks",
        "--pipeline-stages",
        "2",
    ]
    code, out, _ = run(["--cluster", str(path), *chain, "--json"], capsys)
    assert code == 0
    pipeline = json.loads(out)["pipeline"]
    assert pipeline["replicas"] == 2 and [s["rank"] for s in pipeline["stages"]] == [1, 0]
    assert sum(len(s["blocks"]) for s in pipeline["stages"]) == 12 and pipeline["data_parallel_error"] is None
    assert pipeline["step_ms"] > 0 and 0 <= pipeline["bubble"] < 1
    code, out, _ = run(["--cluster", str(path), *chain], capsys)
    assert code == 0 and "pipeline: 2 stages x 2 pipeline(s), 1f1b" in out and "the batch split's step" in out
    code, _, err = run(["--cluster", str(path), *chain[:4], "--pipeline-blocks", "layers"], capsys)
    assert code == 2 and "`blocks` 'layers': SpiralChain has no attribute 'layers'" in err
    # (a bad --sync beside a pipeline is refused too, not taken for a batch split that cannot train)
    bad_sync = ["--sync", "diloco", "--precision", "32-true", "--sync-options", '{"fragments": 3}']
    code, out, err = run(["--cluster", str(path), *chain, *bad_sync], capsys)
    assert code == 2 and "that divides `sync_every=8`" in err and not out


def test_a_missing_cluster_file_exits_2_naming_it(tmp_path, capsys):
    code, _, err = run(["--cluster", str(tmp_path / "nowhere.yaml"), *MODEL], capsys)
    assert code == 2
    assert f"`--cluster {tmp_path / 'nowhere.yaml'}`: No such file or directory" in err and "Traceback" not in err


def test_an_ambiguous_kind_names_every_kind_it_starts(cluster_file, capsys):
    code, _, err = run(["--cluster", cluster_file, *MODEL, "--add", "A100:2"], capsys)
    assert code == 2 and "the closest known kinds: 'A100-40GB', 'A100-80GB'" in err


def test_the_json_keys_are_documented_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert "equal_split_step_ms" in capsys.readouterr().out


def test_the_cli_help_names_the_planner(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "lightning-hetero plan --help" in capsys.readouterr().out


def test_the_plan_says_the_largest_model_with_even_and_memory_sized_shards(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    cluster = tmp_path / "mixed.yaml"
    cluster.write_text("nodes:\n  - {devices: [{kind: RTX-4090, count: 1}, {kind: A100-80GB, count: 1}]}\n")
    code, out, _ = run(["--cluster", str(cluster), *MODEL, "--json"], capsys)
    assert code == 0
    fit = json.loads(out)["memory_fit"]
    assert fit["even_limited_by"] == "RTX-4090"
    assert fit["zero1_even_parameters"] < fit["zero2_even_parameters"] < fit["memory_sized_parameters"]
    code, out, _ = run(["--cluster", str(cluster), *MODEL], capsys)
    assert code == 0 and "memory-sized shards (`stage=2, shards='memory'`)" in out
