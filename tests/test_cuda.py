"""The CUDA paths: device facts through NVML, profiling with out-of-memory probing, fp16/bf16 autocast inside
DeepSpeed's engine (which resets CUDA autocast on entry), and the example on ``accelerator="cuda"``.

Marked ``cuda`` and skipped without a GPU; ``benchmarks/gpu_check.sh`` runs them all on a GPU machine. One GPU is
enough: the fits use one rank (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from conftest import REPO, run_bounded, run_fit

from lightning_hetero.measure.devices import collect_device_facts
from lightning_hetero.precision.choice import best_precision

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multiprocess,  # its tests start jobs
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh there)"),
]


def test_device_facts_read_nvml_and_agree_with_torch():
    facts = collect_device_facts("cuda:0")
    properties = torch.cuda.get_device_properties(0)
    assert facts.kind == "cuda" and facts.index == 0
    assert "nvml" in facts.sources, facts.notes  # nvidia-ml-py is a dependency: NVML must be read
    assert facts.compute_capability == (properties.major, properties.minor)
    assert facts.total_memory_bytes and abs(facts.total_memory_bytes - properties.total_memory) < 2**30
    assert facts.sm_count == properties.multi_processor_count
    assert facts.bf16_native == torch.cuda.is_bf16_supported(including_emulation=False)
    assert facts.supports_bf16 == torch.cuda.is_bf16_supported()  # emulation counts: bf16 runs, slowly
    assert facts.max_sm_clock_mhz and facts.max_sm_clock_mhz > 0
    expected = "bf16-mixed" if facts.compute_capability >= (8, 0) else "16-mixed"
    assert best_precision(facts) == expected
    assert facts.describe().startswith(facts.name) and f"{properties.multi_processor_count} SMs" in facts.describe()


def test_profiling_on_cuda_finds_the_memory_ceiling_by_running_out_of_memory():
    """A memory cap makes the largest probe run out of memory: the profile stops there and caps the ceiling below."""
    from lightning.pytorch import LightningModule

    from lightning_hetero.measure.profiler import profile_training_step

    class Wide(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)])

        def training_step(self, batch, batch_idx):
            return self.layers(batch).square().mean()

    device = torch.device("cuda", 0)
    module = Wide().to(device)

    def make_batch(n: int) -> torch.Tensor:
        return torch.randn(n, 4096, device=device)

    # The cap is what the probe itself reserves at the sizes that must fit, plus 1 GiB: 65536 samples need about
    # 4 GiB more of activations (4 layers x 16 KiB each). Computed from the weights alone, the cap left out what the
    # profiler and cuBLAS reserve beside them, and 256 ran out of memory on an H200.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_training_step(module, make_batch, [64, 256], device)
    fits = torch.cuda.max_memory_reserved(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min((fits + 2**30) / total, 1.0), 0)
    try:
        profile = profile_training_step(
            module, make_batch, [64, 256, 65536], device, free_bytes=float(torch.cuda.mem_get_info(device)[0])
        )
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
    # 65536 samples need about 5 GiB of activations, far beyond the cap: that probe runs out of memory and is dropped.
    assert profile.batch_sizes == (64, 256)
    assert profile.max_batch is not None and 256 <= profile.max_batch < 65536
    assert profile.seconds_per_sample > 0


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_each_precision_reaches_the_step_inside_deepspeeds_engine_on_cuda(precision, tmp_path):
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no bf16")
    strategy = {"device_precision": [precision], "batch_sizes": [16]}
    run = run_fit(
        tmp_path,
        "--accelerator",
        "cuda",
        "--devices",
        "1",
        "--stage",
        "2",
        "--max-epochs",
        "3",
        "--strategy-args",
        json.dumps(strategy),
        "--record-autocast",
        "--record-every-step",
    )
    assert run.returncode == 0, run.output[-4000:]
    seen = json.loads((tmp_path / "autocast_rank0.json").read_text())
    dtype = {"bf16-mixed": "torch.bfloat16", "16-mixed": "torch.float16"}[precision]
    assert seen == {"enabled": True, "dtype": dtype}
    records = [json.loads(line) for line in (tmp_path / "per_step.jsonl").read_text().splitlines()]
    assert len(records) == 12
    # It trained: the steps after the last skipped one (fp16 may skip its first steps while the scale settles from
    # 2**16) changed the parameters.
    total = records[-1]["skipped_steps"]
    settled = next(i for i, record in enumerate(records) if record["skipped_steps"] == total)  # the last skip
    assert settled < len(records) - 2 and records[-1]["params"] != records[settled]["params"]
    if precision == "16-mixed":
        assert records[-1]["loss_scale"] is not None and records[-1]["loss_scale"] >= 1


def test_the_example_trains_on_cuda_with_automatic_precision(tmp_path):
    returncode, output = run_bounded(
        [
            sys.executable,
            "examples/train_spirals.py",
            "--accelerator",
            "cuda",
            "--devices",
            "1",
            "--epochs",
            "1",
            "--no-baseline",
            "--device-precision",
            "auto",
            "--root",
            str(tmp_path),
        ],
        timeout=300,
        cwd=REPO,
    )
    assert returncode == 0, output[-4000:]
    expected = best_precision(collect_device_facts("cuda:0"))
    assert re.search(rf"^0\s+[^\n]*\bSMs\b[^\n]*\)\s+{expected}\s+128\s", output, re.M), output[-3000:]
    assert re.search(r"validation accuracy [\d.]+% -> [\d.]+%", output)


def test_sync_batchnorm_is_applied_on_cuda(tmp_path):
    """DeepSpeedStrategy ignored `Trainer(sync_batchnorm=True)`; the strategy applies it where DDP does (on CPU it is
    refused: tests/test_bad_inputs.py)."""
    run = run_fit(
        tmp_path,
        "--accelerator",
        "cuda",
        "--devices",
        "1",
        "--batch-sizes",
        "8",
        "--max-steps",
        "2",
        "--batchnorm",
        "--sync-batchnorm",
        timeout=300,
    )
    assert run.returncode == 0, run.output[-3000:]
    assert run.result["batchnorm_types"] == ["SyncBatchNorm"]
