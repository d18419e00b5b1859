"""The user's step measured for the step model (simulate/workload.py): it must fit a laptop whatever the cluster."""

from __future__ import annotations

from lightning_hetero.simulate.workload import TIMING_BYTES, TIMING_FLOPS, timing_sizes


def test_a_small_model_is_timed_at_the_sizes_a_run_would_time():
    assert timing_sizes([4, 16, 32, 64], flops_per_sample=1e6, bytes_per_sample=1e4) == [4, 16, 32, 64]


def test_a_gpu_sized_model_is_timed_at_sizes_capped_by_flops_and_memory():
    # ResNet-50: 24.3 GFLOP and 82 MiB of activations per sample; a global batch of 1,024 over 3 GPUs would time up
    # to 682 samples (about 56 GiB of activations here)
    sizes = timing_sizes([42, 170, 341, 682], flops_per_sample=24.3e9, bytes_per_sample=82 * 2**20)
    assert max(sizes) * 24.3e9 <= TIMING_FLOPS and max(sizes) * 82 * 2**20 <= TIMING_BYTES and len(sizes) >= 2
    # BERT-large: even one sample is over the budget: still two sizes, so the line has a slope
    assert timing_sizes([8, 32], flops_per_sample=740e9, bytes_per_sample=1.1e9) == [1, 2]
