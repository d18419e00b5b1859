"""Each operator's FLOPs and bytes (measure/operators.py): the roofline's inputs, counted as a GPU launches them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hetero.measure.operators import (
    OperatorCost,
    OperatorRecorder,
    launched_as_on_cuda,
    operator_lines,
    roofline_seconds,
)


def _record(step) -> list[tuple[float, float, str]]:
    recorder = OperatorRecorder()
    with launched_as_on_cuda(), recorder:
        step()
    return recorder.records


def test_a_matrix_product_counts_its_flops_and_the_bytes_it_reads_and_writes():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert _record(lambda: a @ b) == [(2 * 8 * 16 * 4, 4.0 * (8 * 16 + 16 * 4 + 8 * 4), "matmul")]


def test_views_launch_nothing_and_in_place_operators_count_what_they_read_and_write():
    x = torch.randn(32, 32)
    # t, unsqueeze and view launch no kernel; relu_ reads and writes x
    records = _record(lambda: x.t().unsqueeze(0).view(-1, 32).relu_())
    assert records == [(0.0, 4.0 * 32 * 32 * 2, "other")]
    assert _record(lambda: torch.empty(1000)) == []  # an allocation, no kernel


def test_dropout_is_counted_as_cuda_s_one_fused_kernel_and_the_patch_is_undone():
    x = torch.randn(64, 64)
    records = _record(lambda: nn.functional.dropout(x, 0.1, training=True))
    # CPU alone: bernoulli_, div_, mul over a float mask (4 B each); CUDA: read x, write y and a bool mask
    assert records == [(0.0, 64 * 64 * (4 + 4 + 1), "other")]
    assert nn.functional.dropout.__name__ == "dropout"


def test_attention_through_multi_head_attention_is_counted_as_a_flash_kernel():
    attention = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
    x = torch.randn(2, 16, 32)
    recorder = OperatorRecorder()
    with launched_as_on_cuda(), recorder:
        attention(x, x, x, need_weights=False)[0].sum().backward()
    # the attention matrix (2 x 4 x 16 x 16) is never written: no soft-max or mask operator over it
    products = [r for r in recorder.records if r[2] == "matmul"]
    flash_forward_flops = 4 * 2 * 4 * 16 * 16 * 8
    assert any(r[0] == flash_forward_flops for r in products)
    plain = OperatorRecorder()
    with plain:
        attention(x, x, x, need_weights=False)[0].sum().backward()
    assert len(recorder.records) < len(plain.records)


def test_two_batch_sizes_make_each_operator_a_line():
    layer = nn.Linear(10, 5)
    two, six = torch.randn(2, 10), torch.randn(6, 10)
    small, large = _record(lambda: layer(two)), _record(lambda: layer(six))
    (line,) = operator_lines(small, large, 2, 6)
    assert line.flops == pytest.approx(0) and line.flops_per_sample == pytest.approx(2 * 10 * 5)
    # the weight and bias are read whatever the batch; the input and output grow with it
    assert line.bytes == pytest.approx(4 * (50 + 5)) and line.bytes_per_sample == pytest.approx(4 * (10 + 5))


def test_steps_that_ran_different_operators_fall_back_to_totals_per_kind():
    small = [(10.0, 100.0, "matmul"), (0.0, 50.0, "other")]
    large = [(20.0, 200.0, "matmul"), (0.0, 60.0, "other"), (0.0, 40.0, "other")]
    lines = operator_lines(small, large, 1, 2)
    assert [(op.kind, op.flops_per_sample, op.bytes_per_sample) for op in lines] == [
        ("matmul", 10.0, 100.0),
        ("other", 0.0, 50.0),
    ]


def test_the_roofline_takes_the_slower_of_compute_and_memory_for_each_operator():
    operators = (OperatorCost(1e6, 4e9, 0.0, 1e6, "matmul"), OperatorCost(0.0, 0.0, 1e3, 8e6, "other"))
    fixed, per_sample = roofline_seconds(operators, 1e12, 1e11, 1e9, 0.5, 1e-5)
    assert per_sample == pytest.approx(max(4e9 / 1e12, 0.5e6 / 1e9) + 0.5 * 8e6 / 1e9)
    assert fixed == pytest.approx(1e6 / 1e12 + 0.5e3 / 1e9 + 2e-5)


def test_attention_the_flash_kernel_refuses_is_counted_as_the_step_runs_it():
    # a boolean mask: CPU's flash kernel refuses it (it wants the query's dtype); the count falls back to the plain
    # attention instead of failing the plan
    q, mask = torch.randn(1, 2, 4, 8), torch.ones(4, 4, dtype=torch.bool).tril()
    recorder = OperatorRecorder()
    with launched_as_on_cuda(), recorder:
        out = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert out.shape == q.shape and recorder.records
