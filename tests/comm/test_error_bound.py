"""The error bound of every-step compression (comm/error_bound.py): its options, its pure decisions (the payload
against torch's own count, the largest setting within the byte budget, when to raise), and the hook on a real
one-rank gloo group: the error it measures is the true one, it raises PowerSGD's rank (top-k's ratio) while the error
is above the bound and never past the byte budget, it keeps the error feedback, and it continues exactly from a
checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from lightning_hetero.comm import compression as compress
from lightning_hetero.comm import error_bound as bound
from lightning_hetero.comm.communication import GradientBucket, HookedExchange
from lightning_hetero.runtime.safe_load import load_package_file

# ---------------------------------------------------------------------------------------------- options


def test_options_default_and_off():
    assert bound.check_error_bound_options("powersgd", {}) == bound.ERROR_BOUND_DEFAULTS
    assert bound.check_error_bound_options("topk", {"max_error": 0.3, "error_check_every": 1}) == {
        **bound.ERROR_BOUND_DEFAULTS, "max_error": 0.3, "error_check_every": 1}  # fmt: skip
    assert bound.check_error_bound_options("powersgd", {"max_error": None}) == {}


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"max_error": 0}, "`compression_options={'max_error': 0}` for compression='powersgd' must be a relative"),
        ({"max_error": 1.5}, "must be a relative error in (0, 1)"),
        ({"max_error": "0.1"}, "or None for a fixed setting"),
        ({"max_error": True}, "must be a relative error"),
        ({"error_check_every": 0}, "`compression_options={'error_check_every': 0}` for compression='powersgd' must"),
        ({"error_check_every": 2.5}, "a whole number of optimizer steps"),
        ({"max_bytes_fraction": 0}, "`compression_options={'max_bytes_fraction': 0}`"),
        ({"max_bytes_fraction": 2}, "must be a fraction in (0, 1]"),
        ({"max_error": None, "error_check_every": 3}, "sets ['error_check_every'] with `max_error=None`"),
    ],
)
def test_bad_options_name_the_argument_its_value_and_the_fix(given, message):
    with pytest.raises(ValueError) as raised:
        compress.check_compression("powersgd", given)
    assert message in str(raised.value)


# ---------------------------------------------------------------------------------------------- decisions


@pytest.mark.parametrize("rank", [1, 2, 3, 8, 40])
@pytest.mark.parametrize("rate", [2.0, 1.0])
def test_payload_is_what_torchs_hook_counts(rank, rate, one_rank_group):
    """The entries torch's PowerSGD puts on the wire for a bucket (its own counter), for vectors, small and wide
    matrices, a convolution kernel and a scalar: the byte budget's arithmetic is torch's."""
    shapes = [(64, 48), (48,), (5, 3), (16, 3, 3, 3), (), (100, 2), (200, 300)]
    parameters = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    state = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2, min_compression_rate=rate)
    state.iter = 2  # compressing
    powerSGD_hook(state, GradientBucket(0, parameters, is_last=True)).wait()
    matrices = [bound.matrix_shape(shape) for shape in shapes]
    assert bound.powersgd_payload(matrices, rank, rate) == state.total_numel_after_compression
    assert sum(rows * cols for rows, cols in matrices) == state.total_numel_before_compression


def test_largest_setting_is_the_last_within_the_budget():
    # A 1024x1024 matrix: rank r sends 2048 r of 1048576 entries; a tenth allows r = 51.
    assert bound.largest_setting("powersgd", [(1024, 1024)], 0.1, 2.0) == 51
    assert bound.powersgd_payload([(1024, 1024)], 51, 2.0) <= 0.1 * 1024 * 1024 < bound.powersgd_payload(
        [(1024, 1024)], 52, 2.0)  # fmt: skip
    # Vectors always travel whole: with a budget they alone exceed, rank 1 stays.
    assert bound.largest_setting("powersgd", [(1000, 1), (10, 10)], 0.1, 2.0) == 1
    # From the rank where compressing no longer pays every matrix travels whole (exact): a larger one adds nothing.
    assert bound.largest_setting("powersgd", [(64, 64)], 1.0, 2.0) == 16  # (64 + 64) * 16 * 2 == 64 * 64
    assert bound.largest_setting("powersgd", [(64, 64)], 0.99, 2.0) == 15
    assert bound.largest_setting("topk", [(10, 10)], 0.1, 2.0) == pytest.approx(0.05)  # a value and an index each


@pytest.mark.parametrize(
    ("current", "error", "largest", "expected"),
    [(1, 0.5, 51, 2), (4, 0.5, 51, 8), (32, 0.5, 51, 51), (51, 0.5, 51, None), (4, 0.1, 51, None),
     (4, 0.05, 51, None), (0.01, 0.5, 0.05, 0.02), (0.04, 0.5, 0.05, 0.05), (0.05, 0.9, 0.05, None)],
)  # fmt: skip
def test_raised_setting(current, error, largest, expected):
    raised = bound.raised_setting(current, error, 0.1, largest)
    assert raised == (pytest.approx(expected) if isinstance(expected, float) else expected)
    assert type(raised) is type(expected)  # a rank stays a whole number


def test_sample_indices_are_the_same_on_every_rank_and_change_with_the_step():
    first = bound.sample_indices(100_000, step=10, bucket=0)
    assert torch.equal(first, bound.sample_indices(100_000, step=10, bucket=0))
    assert not torch.equal(first, bound.sample_indices(100_000, step=15, bucket=0))
    assert not torch.equal(first, bound.sample_indices(100_000, step=10, bucket=1))
    assert first.numel() == bound.ERROR_SAMPLE_ENTRIES and first.unique().numel() == first.numel()
    assert torch.equal(bound.sample_indices(50, step=3, bucket=0), torch.arange(50))


# ---------------------------------------------------------------------------------------------- the hook


def _exchange(options, parameters, mode="powersgd"):
    choice = compress.check_compression(mode, options)
    hook, state = compress.builtin_hook(choice, None)
    return HookedExchange(parameters, hook, state), state


def _step(exchange, parameters, gradients):
    for parameter, gradient in zip(parameters, gradients):
        parameter.grad = gradient.clone()
    exchange()
    return [parameter.grad.clone() for parameter in parameters]


def test_the_measured_error_is_the_true_one_and_the_rank_doubles_while_above(one_rank_group):
    """A random 40x30 gradient (no low-rank structure): rank 1 is far from it. Checks every 2 steps after a warm-up
    of 2; the sample covers the whole bucket (under 2048 entries), so the error is exact."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(40, 30)), torch.nn.Parameter(torch.zeros(30))]
    exchange, state = _exchange({"start_powerSGD_iter": 2, "error_check_every": 2, "max_bytes_fraction": 1.0},
                                parameters)  # fmt: skip
    ranks, errors = [], {}
    for step in range(12):
        gradients = [torch.randn(40, 30), torch.randn(30)]
        ranks.append(state.setting)
        averaged = _step(exchange, parameters, gradients)
        exact = torch.cat([g.reshape(-1) for g in gradients])
        got = torch.cat([g.reshape(-1) for g in averaged])
        errors[step] = float((got - exact).norm() / exact.norm())
    assert [check.step for check in state.checks] == [2, 4, 6, 8, 10]  # none in the warm-up
    for check in state.checks:
        assert check.relative_error == pytest.approx(errors[check.step], rel=1e-5)
        assert check.setting == ranks[check.step]
    # Doubled after each check above 0.1, from the next step, up to rank 9, where the 40x30 matrix travels whole
    # ((40 + 30) * 9 * 2 > 1200), which the budget of 1.0 allows; whole, the exchange is exact and the bound is met.
    assert ranks == [1, 1, 1, 2, 2, 4, 4, 8, 8, 9, 9, 9]
    assert [check.raised_to for check in state.checks] == [2, 4, 8, 9, None]
    assert all(check.relative_error > 0.1 for check in state.checks[:4]) and state.checks[4].relative_error < 1e-6
    assert state.inner_state.error_dict  # the error feedback survives the raises


def test_a_gradient_the_compression_carries_is_left_alone(one_rank_group):
    """A rank-1 gradient: PowerSGD's rank 1 carries it within the bound, so the rank stays and the error is ~0."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(40, 30))]
    exchange, state = _exchange({"start_powerSGD_iter": 2, "error_check_every": 1}, parameters)
    for _ in range(8):
        _step(exchange, parameters, [torch.outer(torch.randn(40), torch.randn(30))])
    assert len(state.checks) == 6 and state.setting == 1
    assert max(check.relative_error for check in state.checks) < 0.01


def test_the_byte_budget_caps_the_rank(one_rank_group):
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(64, 64))]
    exchange, state = _exchange({"start_powerSGD_iter": 2, "error_check_every": 1, "max_bytes_fraction": 0.1},
                                parameters)  # fmt: skip
    for _ in range(10):
        _step(exchange, parameters, [torch.randn(64, 64)])
    # A tenth of 4096 entries allows rank 3 ((64 + 64) * 3 = 384 <= 409.6): 1 -> 2 -> 3, then held.
    assert [check.raised_to for check in state.checks][:3] == [2, 3, None] and state.setting == 3
    summary = state.summary()
    assert summary["start"] == 1 and summary["current"] == summary["largest"] == 3
    assert summary["last_error"] == state.checks[-1].relative_error > 0.1


def test_topk_doubles_its_ratio(one_rank_group):
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(2000))]
    exchange, state = _exchange({"ratio": 0.01, "error_check_every": 1}, parameters, mode="topk")
    for _ in range(4):
        _step(exchange, parameters, [torch.randn(2000)])
    assert [check.setting for check in state.checks] == pytest.approx([0.01, 0.02, 0.04, 0.05])
    assert state.summary()["setting"] == "ratio"


def test_a_checkpoint_continues_the_uninterrupted_run(one_rank_group, tmp_path):
    """Saved after a raise, restored into a fresh state: the next steps' gradients, rank and checks are the
    uninterrupted run's (weights-only load)."""
    torch.manual_seed(0)
    gradients = [[torch.randn(40, 30)] for _ in range(10)]
    options = {"start_powerSGD_iter": 2, "error_check_every": 2, "max_bytes_fraction": 1.0}
    parameters = [torch.nn.Parameter(torch.zeros(40, 30))]
    exchange, state = _exchange(options, parameters)
    through = [_step(exchange, parameters, step) for step in gradients]
    parameters = [torch.nn.Parameter(torch.zeros(40, 30))]
    exchange, state_before = _exchange(options, parameters)
    for step in gradients[:5]:
        _step(exchange, parameters, step)
    torch.save(compress.hook_state_dict(state_before), tmp_path / "state.pt")
    resumed, fresh = _exchange(options, parameters)
    compress.load_hook_state_dict(fresh, load_package_file(tmp_path / "state.pt"))
    assert fresh.setting == state_before.setting == 4
    after = [_step(resumed, parameters, step) for step in gradients[5:]]
    for expected, got in zip(through[5:], after):
        assert torch.equal(expected[0], got[0])
    assert fresh.checks == state.checks and fresh.setting == state.setting


def test_a_large_bucket_is_checked_on_a_sample(one_rank_group):
    """Over 2048 entries the error is estimated from a sample: close to the true one for a spread-out error."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(300, 200))]
    exchange, state = _exchange({"start_powerSGD_iter": 2, "error_check_every": 1, "max_error": 0.9999}, parameters)
    for _ in range(4):
        gradient = torch.randn(300, 200)
        averaged = _step(exchange, parameters, [gradient])
    true_error = float((averaged[0] - gradient).norm() / gradient.norm())
    assert state.checks[-1].relative_error == pytest.approx(true_error, rel=0.05)
    assert math.isfinite(state.checks[-1].relative_error) and state.setting == 1  # below 0.99: kept


# ---------------------------------------------------------------------------------------------- report and monitor


def _checked_state(steps=7):
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(40, 30))]
    exchange, state = _exchange({"start_powerSGD_iter": 2, "error_check_every": 2, "max_bytes_fraction": 1.0},
                                parameters)  # fmt: skip
    run = lambda count: [_step(exchange, parameters, [torch.randn(40, 30)]) for _ in range(count)]  # noqa: E731
    run(steps)
    return state, run


def test_the_report_says_the_error_and_the_setting_it_ended_at(one_rank_group, capsys):
    from lightning_hetero.watch import report

    state, _ = _checked_state()
    summary = state.summary()
    assert [check["step"] for check in summary["checks"]] == [2, 4, 6] and summary["current"] == 8
    assert summary["bytes_fraction"] == pytest.approx(bound.powersgd_payload([(40, 30)], 8, 2.0) / 1200)
    text = report.error_bound_text(summary)
    assert text == (f"; compression error {state.checks[-1].relative_error:.3f} at the last of 3 checks (max_error"
                    " 0.1) at matrix_approximation_rank 8 (raised from 1)")  # fmt: skip
    assert report.error_bound_text(None) == "" and report.error_bound_text({**summary, "last_error": None}) == ""


def test_the_monitor_logs_each_check_at_its_step_once(one_rank_group):
    from types import SimpleNamespace

    from lightning_hetero import HeteroMonitor
    from lightning_hetero.watch.watcher import Watcher

    class Logger:
        def __init__(self) -> None:
            self.logged: list[tuple[int, dict]] = []

        def log_metrics(self, metrics, step):
            self.logged.append((step, metrics))

    state, run = _checked_state(steps=0)
    logger = Logger()
    watcher = Watcher(torch.device("cpu"), window=20, added_seconds=lambda: 0.0, wire_bytes=lambda: None,
                      gather_tensor=lambda tensor: [tensor])  # fmt: skip
    strategy = SimpleNamespace(watcher=watcher, communication=SimpleNamespace(error_bound=lambda: state))
    trainer = SimpleNamespace(strategy=strategy, is_global_zero=True, loggers=[logger], global_step=0)
    monitor = HeteroMonitor()
    monitor.on_train_start(trainer, None)
    run(7)
    monitor.on_train_batch_end(trainer, None, None, None, 0)
    monitor.on_train_batch_end(trainer, None, None, None, 1)  # nothing new: nothing logged twice
    checks = [(step, metrics) for step, metrics in logger.logged if "hetero/compression_error" in metrics]
    assert len(state.checks) == 3 and checks == [
        (check.step, {"hetero/compression_error": check.relative_error, "hetero/compression_rank": check.setting})
        for check in state.checks
    ]
    resumed, logger.logged = HeteroMonitor(), []  # a resume: the checks so far were logged by the fit that made them
    resumed.on_train_start(trainer, None)
    resumed.on_train_batch_end(trainer, None, None, None, 0)
    assert not [metrics for _, metrics in logger.logged if "hetero/compression_error" in metrics]
