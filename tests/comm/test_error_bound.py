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
        **bound.ERROR_BOUND_DEFAULTS,
        "max_error": 0.3,
        "error_check_every": 1,
    }
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
    assert (
        bound.powersgd_payload([(1024, 1024)], 51, 2.0)
        <= 0.1 * 1024 * 1024
        < bound.powersgd_payload([(1024, 1024)], 52, 2.0)
    )
    # Vectors always travel whole: with a budget they alone exceed, rank 1 stays.
    assert bound.largest_setting("powersgd", [(1000, 1), (10, 10)], 0.1, 2.0) == 1
    # From the rank where compressing no longer pays every matrix travels whole (exact): a larger one adds nothing.
    assert bound.largest_setting("powersgd", [(64, 64)], 1.0, 2.0) == 16  # (64 + 64) * 16 * 2 == 64 * 64
    assert bound.largest_setting("powersgd", [(64, 64)], 0.99, 2.0) == 15
    assert bound.largest_setting("topk", [(10, 10)], 0.1, 2.0) == pytest.approx(0.05)  # a value and an index each
    assert bound.largest_setting("topk", [(100, 100)], 0.1, 2.0, overhead=200) == pytest.approx(0.04)
    assert bound.largest_setting("powersgd", [(1024, 1024)], 0.1, 2.0, overhead=2048) == 50  # (2048 fewer entries)


@pytest.mark.parametrize(
    ("current", "error", "largest", "expected"),
    [
        (1, 0.5, 51, 2),
        (4, 0.5, 51, 8),
        (32, 0.5, 51, 51),
        (51, 0.5, 51, None),
        (4, 0.1, 51, None),
        (4, 0.05, 51, None),
        (0.01, 0.5, 0.05, 0.02),
        (0.04, 0.5, 0.05, 0.05),
        (0.05, 0.9, 0.05, None),
    ],
)
def test_raised_setting(current, error, largest, expected):
    raised = bound.raised_setting(current, error, 0.1, largest)
    assert raised == (pytest.approx(expected) if isinstance(expected, float) else expected)
    assert type(raised) is type(expected)  # a rank stays a whole number


def test_sample_indices_are_the_same_on_every_rank_and_change_with_the_step():
    first = bound.sample_indices(100_000, step=10, bucket=0)
    assert torch.equal(first, bound.sample_indices(100_000, step=10, bucket=0))
    assert not torch.equal(first, bound.sample_indices(100_000, step=15, bucket=0))
    assert not torch.equal(first, bound.sample_indices(100_000, step=10, bucket=1))
    assert first.numel() == bound.ERROR_SAMPLE_ENTRIES and 0 <= int(first.min()) and int(first.max()) < 100_000
    assert torch.equal(bound.sample_indices(50, step=3, bucket=0), torch.arange(50))


# ---------------------------------------------------------------------------------------------- the hook


def _exchange(options, parameters, mode="powersgd"):
    choice = compress.check_compression(mode, {"max_error": 0.1, **options})
    hook, state = compress.builtin_hook(choice, None)
    return HookedExchange(parameters, hook, state), state


def _drifting(step, rows=40, cols=30):
    """Rank 1 while PowerSGD warms up (so its calibration keeps rank 1), then without low-rank structure."""
    return torch.outer(torch.randn(rows), torch.randn(cols)) if step < 2 else torch.randn(rows, cols)


def _step(exchange, parameters, gradients):
    for parameter, gradient in zip(parameters, gradients):
        parameter.grad = gradient.clone()
    exchange()
    return [parameter.grad.clone() for parameter in parameters]


def test_the_measured_error_is_the_true_one_and_the_rank_doubles_while_above(one_rank_group):
    """A 40x30 gradient of rank 1 during a warm-up of 2 steps (the calibration keeps rank 1), then random (no low-rank
    structure: rank 1 is far from it). Checks at the first compressed step, every 3 steps, and at the step after each
    raise; the sample covers the whole bucket (under 2048 entries), so the error is exact: against what the hook was
    given, the gradient plus its feedback."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(40, 30)), torch.nn.Parameter(torch.zeros(30))]
    exchange, state = _exchange(
        {"start_powerSGD_iter": 2, "error_check_every": 3, "max_bytes_fraction": 1.0}, parameters
    )
    ranks, errors = [], {}
    for step in range(16):
        gradients = [_drifting(step), torch.randn(30)]
        feedback = state.inner_state.error_dict.get(0, torch.zeros(1230)).clone()
        ranks.append(state.setting)
        averaged = _step(exchange, parameters, gradients)
        given = torch.cat([g.reshape(-1) for g in gradients]) + feedback
        got = torch.cat([g.reshape(-1) for g in averaged])
        errors[step] = float((got - given).norm() / given.norm())
    calibration, *checks = state.checks
    assert calibration.step == 1 and calibration.estimated and calibration.raised_to is None
    assert checks[0].step == 2 and not checks[0].estimated  # the first compressed step; none in the warm-up
    for check, following in zip(checks, checks[1:]):
        assert following.step == check.step + (1 if check.raised_to else 3)
    largest = state.largest()
    # Rank 9 would send the 40x30 matrix whole ((40 + 30) * 9 * 2 > 1200): 1230 entries, more than the budget of
    # 1230 less the checks' (1230 + 2) / 3 a step.
    assert largest == 8 and bound.largest_setting("powersgd", [(40, 30), (30, 1)], 1.0, 2.0) == 9
    for check in checks:
        assert check.relative_error == pytest.approx(errors[check.step], rel=1e-5, abs=1e-6)
        assert check.setting == ranks[check.step]
        assert check.raised_to == bound.raised_setting(check.setting, check.relative_error, 0.1, largest)
        if check.raised_to:
            assert ranks[check.step + 1] == check.raised_to  # from the next step on
    # Doubled while above 0.1: 1 -> 2 -> 4 -> 8, the largest; above it still, and held there.
    assert [check.raised_to for check in checks] == [2, 4, 8] + [None] * (len(checks) - 3) and ranks[-1] == 8
    assert all(check.relative_error > 0.1 for check in checks)
    assert state.inner_state.error_dict  # the error feedback survives the raises


def test_before_compressing_the_rank_is_chosen_on_the_exact_average(one_rank_group, caplog):
    """A rank-4 signal plus 1 % noise in a 60x50 gradient: on PowerSGD's last uncompressed step the calibration
    estimates ranks 1, 2, 4, 8... on the exact average and starts at 4, the first within 0.1; its figure for rank 1 is
    PowerSGD's first step on that average. With a budget below rank 4, it starts at the most the budget allows."""
    torch.manual_seed(0)
    signal = lambda: torch.randn(60, 4) @ torch.randn(4, 50) + 0.01 * torch.randn(60, 50)  # noqa: E731
    for fraction, expected in ((1.0, 4), (0.05, 1)):  # (0.05 of 3000 entries: (60 + 50) * 2 > 150, so rank 1)
        parameters = [torch.nn.Parameter(torch.zeros(60, 50))]
        exchange, state = _exchange({"start_powerSGD_iter": 3, "max_bytes_fraction": fraction}, parameters)
        gradients = [signal() for _ in range(4)]
        for step in gradients:
            _step(exchange, parameters, [step])
        calibration = state.checks[0]
        assert calibration.estimated and calibration.step == 2 and calibration.setting == 1
        assert calibration.raised_to == (expected if expected != 1 else None) and state.setting == expected
        averaged = gradients[2]  # (one rank: the average is its gradient)
        direct = bound.first_power_step_error(averaged, 1, torch.Generator().manual_seed(2))
        assert calibration.relative_error == pytest.approx(math.sqrt(direct) / float(averaged.norm()), rel=1e-6)
        assert state.checks[1].step == 3 and not state.checks[1].estimated  # the first compressed step is checked
        assert state.checks[1].relative_error < 0.1 or fraction < 1.0
    assert "HeteroStrategy: powersgd starts at matrix_approximation_rank 4, not 1: its estimated" in caplog.text
    assert "8: 0.0" in caplog.text and "the first within max_error 0.1." in caplog.text


def test_a_gradient_the_compression_carries_is_left_alone(one_rank_group):
    """A rank-1 gradient: PowerSGD's rank 1 carries it within the bound, so the rank stays and the error is ~0."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(40, 30))]
    exchange, state = _exchange({"start_powerSGD_iter": 2, "error_check_every": 1}, parameters)
    for _ in range(8):
        _step(exchange, parameters, [torch.outer(torch.randn(40), torch.randn(30))])
    assert len(state.checks) == 7 and state.checks[0].estimated and state.setting == 1
    assert max(check.relative_error for check in state.checks) < 0.01


def test_the_byte_budget_caps_the_rank_counting_the_checks(one_rank_group):
    """A tenth of a 256x256 gradient's 65536 entries, less what the checks send (2048 sampled entries and 2 sums,
    every step here): (65536 * 0.1 - 2050) / 512 allows rank 8, where the payload alone would allow 12. Rank 1 stays
    through the rank-1 warm-up, then the checks double it to 8 and hold it there."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(256, 256))]
    exchange, state = _exchange(
        {"start_powerSGD_iter": 2, "error_check_every": 1, "max_bytes_fraction": 0.1}, parameters
    )
    for step in range(8):
        _step(exchange, parameters, [_drifting(step, 256, 256)])
    assert bound.largest_setting("powersgd", [(256, 256)], 0.1, 2.0) == 12
    assert state.check_overhead() == 2050 and state.largest() == 8
    assert [check.raised_to for check in state.checks][:5] == [None, 2, 4, 8, None] and state.setting == 8
    summary = state.summary()
    assert summary["start"] == 1 and summary["current"] == summary["largest"] == 8
    assert summary["bytes_fraction"] + 2050 / 65536 <= 0.1 < state.bytes_fraction(9) + 2050 / 65536
    assert summary["last_error"] == state.checks[-1].relative_error > 0.1


def test_topk_doubles_its_ratio(one_rank_group):
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(100_000))]
    options = {"ratio": 0.01, "error_check_every": 1, "max_bytes_fraction": 0.1}
    exchange, state = _exchange(options, parameters, mode="topk")
    for _ in range(4):
        _step(exchange, parameters, [torch.randn(100_000)])
    # At most (0.1 * 100000 - 2050) / 100000 / 2: a value and an index per entry, and the checks' entries.
    assert [check.setting for check in state.checks] == pytest.approx([0.01, 0.02, 0.03975, 0.03975])
    assert state.summary()["setting"] == "ratio"


def test_a_checkpoint_continues_the_uninterrupted_run(one_rank_group, tmp_path):
    """Saved after a raise, restored into a fresh state: the next steps' gradients, rank and checks are the
    uninterrupted run's (weights-only load)."""
    torch.manual_seed(0)
    gradients = [[_drifting(step)] for step in range(10)]
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
    assert fresh.setting == state_before.setting == 8  # (raised at steps 2, 3 and 4, after a calibration at 1)
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
        given = gradient + state.inner_state.error_dict.get(0, torch.zeros(60_000)).view(300, 200)
        averaged = _step(exchange, parameters, [gradient])
    true_error = float((averaged[0] - given).norm() / given.norm())
    assert state.checks[-1].relative_error == pytest.approx(true_error, rel=0.05)
    assert math.isfinite(state.checks[-1].relative_error) and state.setting == 1  # below 0.99: kept


# ---------------------------------------------------------------------------------------------- report and monitor


def _checked_state(steps=7):
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(40, 30))]
    exchange, state = _exchange(
        {"start_powerSGD_iter": 2, "error_check_every": 2, "max_bytes_fraction": 1.0}, parameters
    )
    done: list[int] = []

    def run(count):
        for _ in range(count):
            _step(exchange, parameters, [_drifting(len(done))])
            done.append(1)

    run(steps)
    return state, run


def test_the_report_says_the_error_and_the_setting_it_ended_at(one_rank_group, capsys):
    from lightning_hetero.watch import report

    state, _ = _checked_state(steps=5)
    summary = state.summary()
    assert [check["step"] for check in summary["checks"]] == [1, 2, 3, 4] and summary["current"] == 8
    assert summary["bytes_fraction"] == pytest.approx(bound.powersgd_payload([(40, 30)], 8, 2.0) / 1200)
    text = report.error_bound_text(summary)
    assert text == (
        f"; compression error {state.checks[-1].relative_error:.3f} at the last of 4 checks (max_error"
        " 0.1) at matrix_approximation_rank 8 (raised from 1)"
    )
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
    watcher = Watcher(
        torch.device("cpu"),
        window=20,
        added_seconds=lambda: 0.0,
        wire_bytes=lambda: None,
        gather_tensor=lambda tensor: [tensor],
    )
    strategy = SimpleNamespace(watcher=watcher, communication=SimpleNamespace(error_bound=lambda: state))
    trainer = SimpleNamespace(strategy=strategy, is_global_zero=True, loggers=[logger], global_step=0)
    monitor = HeteroMonitor()
    monitor.on_train_start(trainer, None)
    run(7)
    monitor.on_train_batch_end(trainer, None, None, None, 0)
    monitor.on_train_batch_end(trainer, None, None, None, 1)  # nothing new: nothing logged twice
    checks = [(step, metrics) for step, metrics in logger.logged if "hetero/compression_error" in metrics]
    assert len(state.checks) == 5 and checks == [
        (check.step, {"hetero/compression_error": check.relative_error, "hetero/compression_rank": check.setting})
        for check in state.checks
    ]
    resumed, logger.logged = HeteroMonitor(), []  # a resume: the checks so far were logged by the fit that made them
    resumed.on_train_start(trainer, None)
    resumed.on_train_batch_end(trainer, None, None, None, 0)
    assert not [metrics for _, metrics in logger.logged if "hetero/compression_error" in metrics]


def test_a_non_finite_gradient_is_neither_recorded_nor_acted_on(one_rank_group):
    """A NaN at a check step: no figure in the report (it would not be valid JSON), no raise, and the next step is
    checked instead."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(40, 30))]
    exchange, state = _exchange(
        {"start_powerSGD_iter": 2, "error_check_every": 5, "max_bytes_fraction": 1.0}, parameters
    )
    for step in range(2):
        _step(exchange, parameters, [_drifting(step)])
    poisoned = torch.outer(torch.randn(40), torch.randn(30))
    poisoned[0, 0] = float("nan")
    _step(exchange, parameters, [poisoned])  # step 2: the first compressed step, a check
    assert [check.step for check in state.checks] == [1] and state.setting == 1 and state.next_check == 3
    state.inner_state.error_dict.clear()  # (the NaN stays in the feedback and the warm-started P and Q: the
    state.change_setting(state.setting)  # non-finite guard's matter, which skips such a step; here: dropped)
    _step(exchange, parameters, [torch.outer(torch.randn(40), torch.randn(30))])
    assert [check.step for check in state.checks] == [1, 3] and math.isfinite(state.checks[-1].relative_error)


def test_no_calibration_without_every_buckets_shape_and_checks_are_labelled_by_the_optimizer_step(one_rank_group):
    """Buckets that change on PowerSGD's last uncompressed step leave the budget unknown: no calibration, the checks
    alone raise. A check's step is the optimizer step the strategy gives (DeepSpeed's global step), not the count of
    exchanges this state saw (a resume with a fresh state, skipped steps)."""
    from lightning_hetero.comm.communication import forget_bucket_state

    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.zeros(40, 30))]
    exchange, state = _exchange({"start_powerSGD_iter": 2, "max_bytes_fraction": 1.0}, parameters)
    state.step_label = lambda: 100 + state.steps_done
    _step(exchange, parameters, [torch.randn(40, 30)])
    forget_bucket_state(state)
    assert not state.shapes_complete
    _step(exchange, parameters, [torch.randn(40, 30)])  # step 1: the last uncompressed one
    _step(exchange, parameters, [torch.randn(40, 30)])
    assert [(check.step, check.estimated) for check in state.checks] == [(102, False)]
    assert state.shapes_complete and state.checks[0].raised_to == 2


def test_a_hierarchical_non_leader_has_no_error_bound():
    from types import SimpleNamespace

    from lightning_hetero.comm.communication import Communication

    choice = compress.check_compression("powersgd")
    communication = Communication(choice, hierarchical=True)
    _, state = compress.builtin_hook(choice, None)
    for leader in (True, False):
        communication.exchange = SimpleNamespace(nodes=SimpleNamespace(is_leader=leader), state=state)
        assert (communication.error_bound() is state) == leader  # (only the leaders run the hook and its checks)
