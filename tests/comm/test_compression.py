"""Compression, topology and the wire count as pure decisions and small pieces, in one process (no training).

What the user relies on: every `compression` / `hierarchical` value is accepted or refused with a message naming it;
a hook is refused where DeepSpeed's exchange cannot be hooked, naming the stage that can; top-k's error feedback
never loses a gradient (what it does not send now, it sends later); a hooked exchange puts every gradient through the
hook once per optimizer step and writes the result back; hook state round-trips through a checkpoint; the nodes and
the emulated link are what the environment says; the bytes counted are each rank's payload, split by node.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from lightning_hetero.comm import compression as compress
from lightning_hetero.comm import topk
from lightning_hetero.comm.communication import GradientBucket, HookedExchange, bucket_parameters
from lightning_hetero.comm.error_bound import ERROR_BOUND_DEFAULTS, ErrorBoundState
from lightning_hetero.comm.topology import (
    LINK_ENV_VAR,
    NODES_ENV_VAR,
    SlowLink,
    Topology,
    check_hierarchical,
    decide_hierarchical,
    emulated_nodes_from_environment,
    link_crossing_bytes,
    slow_link_from_environment,
    topology_from_hosts,
)
from lightning_hetero.comm.wire import WireMeter, senders
from lightning_hetero.runtime.safe_load import load_package_file

# ---------------------------------------------------------------------------------------------- the argument


@pytest.mark.parametrize(
    ("value", "mode"), [(None, None), ("fp16", "fp16"), ("BF16", "bf16"), ("powersgd", "powersgd"), ("topk", "topk")]
)
def test_accepted_compression_values(value, mode):
    choice = compress.check_compression(value)
    assert choice.mode == mode
    assert choice.needs_hook == (mode in ("powersgd", "topk"))


def test_defaults_are_filled_in_and_options_override_them():
    bound = ERROR_BOUND_DEFAULTS  # on by default: the error is checked and the rank raised
    assert compress.check_compression("powersgd").options == {**compress.POWERSGD_DEFAULTS, **bound}
    options = compress.check_compression("powersgd", {"matrix_approximation_rank": 4}).options
    assert options == {**compress.POWERSGD_DEFAULTS, "matrix_approximation_rank": 4, **bound}
    assert compress.check_compression("topk", {"ratio": 0.1}).options == {"ratio": 0.1, **bound}
    fixed = compress.check_compression("powersgd", {"max_error": None}).options
    assert fixed == {**compress.POWERSGD_DEFAULTS, "max_error": None}
    assert compress.split_options(fixed) == (compress.POWERSGD_DEFAULTS, {})
    assert compress.split_options(options) == ({**compress.POWERSGD_DEFAULTS, "matrix_approximation_rank": 4}, bound)


def test_a_custom_hook_and_a_hook_with_its_state():
    choice = compress.check_compression(default_hooks.allreduce_hook)
    assert choice.mode == "custom" and choice.needs_hook and choice.hook is default_hooks.allreduce_hook
    assert "allreduce_hook" in choice.describe()  # the same text on every rank (a callable is not)
    state = object()
    paired = compress.check_compression((default_hooks.allreduce_hook, state))
    assert paired.hook_state is state


@pytest.mark.parametrize(
    ("value", "options", "message"),
    [
        ("gzip", None, "`compression='gzip'` is not one of ['fp16', 'bf16', 'powersgd', 'topk', 'int8', 'int4']"),
        (16, None, "`compression=16` is not one of"),
        (None, {"ratio": 0.1}, "was given without `compression`"),
        ("fp16", {"ratio": 0.1}, "has nothing to set for compression='fp16'"),
        ("powersgd", {"rank": 2}, "is not valid for compression='powersgd'"),
        ("powersgd", {"start_powerSGD_iter": 1}, "Expect `start_powerSGD_iter` > 1"),  # torch's own check
        ("powersgd", {"process_group": None}, "the strategy gives PowerSGD its group"),
        ("topk", {"ratio": 0}, "must be a fraction in (0, 1]"),
        ("topk", {"ratio": 1.5}, "must be a fraction in (0, 1]"),
        ("topk", {"ratio": True}, "must be a fraction in (0, 1]"),
        ("topk", {"k": 3}, "its options are `ratio` and the error bound's"),
        ("topk", [("ratio", 0.1)], "must be a dict"),
    ],
)
def test_refused_compression_values_name_the_argument(value, options, message):
    with pytest.raises(ValueError) as error:
        compress.check_compression(value, options)
    assert message in str(error.value)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("value", ["powersgd", "topk", default_hooks.allreduce_hook])
def test_hooks_are_refused_beyond_zero_0_naming_the_stage_that_works(value, stage):
    with pytest.raises(ValueError) as error:
        compress.check_exchange(compress.check_compression(value), "auto", stage)
    assert "needs `stage=0`" in str(error.value) and f"ZeRO-{stage} reduces gradients inside" in str(error.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_half_precision_and_auto_hierarchical_work_at_every_stage(stage):
    for value in ("fp16", "bf16", None):
        compress.check_exchange(compress.check_compression(value), "auto", stage)
        compress.check_exchange(compress.check_compression(value), False, stage)
    if stage:
        with pytest.raises(ValueError, match="`hierarchical=True` needs `stage=0`"):
            compress.check_exchange(compress.check_compression(None), True, stage)


def test_deepspeed_does_half_precision_unless_the_exchange_is_ours():
    fp16, bf16 = compress.check_compression("fp16"), compress.check_compression("bf16")
    assert compress.deepspeed_entries(fp16, hooked=False) == {"communication_data_type": "fp16"}
    assert compress.deepspeed_entries(bf16, hooked=False) == {"communication_data_type": "bf16"}
    assert compress.deepspeed_entries(fp16, hooked=True) == {}  # torch's fp16 hook compresses between the leaders
    assert compress.deepspeed_entries(compress.check_compression("powersgd"), hooked=True) == {}
    hook, _ = compress.builtin_hook(fp16, None)
    assert hook is default_hooks.fp16_compress_hook
    assert compress.hooked_exchange_reason(compress.CompressionChoice(), hierarchical=False) is None
    assert compress.hooked_exchange_reason(compress.CompressionChoice(), hierarchical=True) == "hierarchical reduction"


def test_a_config_that_also_sets_the_wire_dtype_is_refused():
    with pytest.raises(ValueError, match="Keep one"):
        compress.check_config_compression(compress.check_compression("fp16"), {"communication_data_type": "bf16"})
    compress.check_config_compression(compress.CompressionChoice(), {"communication_data_type": "bf16"})


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients"])
def test_zero_plus_plus_quantization_is_refused_off_cuda(key):
    config = {"zero_optimization": {"stage": 3, key: True, "zero_hpz_partition_size": 2}}
    with pytest.raises(ValueError, match=f"`zero_optimization.{key}=True`, which needs CUDA"):
        compress.check_zero_plus_plus(config, "cpu")
    compress.check_zero_plus_plus(config, "cuda")
    compress.check_zero_plus_plus({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, "cpu")
    with pytest.raises(ValueError, match="ZeRO-3 only"):
        compress.check_zero_plus_plus({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}, "cuda")


# ---------------------------------------------------------------------------------------------- hooks and buckets


def test_topk_error_feedback_sends_every_gradient_eventually(one_rank_group):
    """Conservation: what was sent over the steps plus what is held back equals every gradient given."""
    torch.manual_seed(0)
    state = topk.TopKState(None, ratio=0.1)
    given, sent = torch.zeros(50), torch.zeros(50)
    for _ in range(6):
        gradient = torch.randn(50)
        given += gradient
        bucket = FakeBucket(gradient.clone())
        result = topk.topk_hook(state, bucket).wait()
        assert int((result != 0).sum()) <= math.ceil(0.1 * 50)  # at most k entries travel
        sent += result
    assert torch.allclose(sent + state.error_dict[0], given, atol=1e-5)


class FakeBucket:
    def __init__(self, buffer: torch.Tensor, index: int = 0) -> None:
        self._buffer = buffer
        self._index = index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index


def test_buckets_follow_dtype_and_the_size_cap():
    f32, f16 = torch.float32, torch.float16
    shapes = [(10, f32), (10, f32), (30, f32), (5, f16), (5, f32)]
    parameters = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in shapes]
    buckets = bucket_parameters(parameters, cap_bytes=80)
    assert [[p.numel() for p in bucket] for bucket in buckets] == [[10, 10], [30], [5], [5]]
    assert len(bucket_parameters(parameters)) == 3  # by dtype only under DDP's 25 MB


def test_a_bucket_is_views_into_one_buffer_and_writes_back():
    first, second = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    first.grad = torch.ones(2, 3)  # `second` has no gradient: it enters as zeros
    bucket = GradientBucket(0, [first, second], is_last=True)
    assert bucket.buffer().tolist() == [1.0] * 6 + [0.0] * 4
    views = bucket.gradients()
    assert [tuple(v.shape) for v in views] == [(2, 3), (4,)]
    views[0].mul_(3)  # a hook writing through the views (as PowerSGD's decompression does)
    views[1].fill_(2)
    bucket.write_back()
    assert first.grad.tolist() == [[3.0] * 3] * 2 and second.grad.tolist() == [2.0] * 4


def test_the_hooked_exchange_runs_the_hook_once_per_step_and_not_on_skipped_steps(one_rank_group):
    model = torch.nn.Linear(3, 2)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 4.0)
    calls = []

    def halving_hook(state, bucket):
        calls.append(bucket.index())
        future = torch.futures.Future()
        future.set_result(bucket.buffer() / 2)
        return future

    boundary, skip = [False], [False]
    exchange = HookedExchange(list(model.parameters()), halving_hook, None, None, lambda: boundary[0], lambda: skip[0])
    exchange()  # DeepSpeed's post-backward call: not the boundary, nothing travels
    assert calls == [] and model.weight.grad.unique().tolist() == [4.0]
    boundary[0] = True
    exchange()
    assert calls == [0] and model.weight.grad.unique().tolist() == [2.0] and model.bias.grad.unique().tolist() == [2.0]
    skip[0] = True  # an fp16 overflow every rank agreed on
    exchange()
    assert calls == [0]


@pytest.mark.parametrize("mode", ["powersgd", "topk"])
@pytest.mark.parametrize("bounded", [False, True])
def test_hook_state_round_trips_through_a_checkpoint_dict(mode, bounded, one_rank_group, tmp_path):
    torch.manual_seed(0)
    options = {"start_powerSGD_iter": 2} if mode == "powersgd" else {}
    choice = compress.check_compression(mode, {**options, "max_error": 0.1 if bounded else None})
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    hook, state = compress.builtin_hook(choice, None)
    exchange = HookedExchange(list(model.parameters()), hook, state)
    for _ in range(4):
        for parameter in model.parameters():
            parameter.grad = torch.randn_like(parameter)
        exchange()
    saved = compress.hook_state_dict(state)
    torch.save(saved, tmp_path / "state.pt")
    _, fresh = compress.builtin_hook(choice, None)
    # (weights-only: PowerSGD's numpy random state is saved as tensors and numbers)
    compress.load_hook_state_dict(fresh, load_package_file(tmp_path / "state.pt"))
    if bounded:  # the bound's progress (checks, the setting it raised) around the compression's own
        assert isinstance(state, ErrorBoundState) and isinstance(fresh, ErrorBoundState)
        assert fresh.checks == state.checks and fresh.setting == state.setting and fresh.steps_done == 4
        saved, state, fresh = saved["inner"], state.inner_state, fresh.inner_state
    assert not set(saved) - compress.PROGRESS_SLOTS  # progress only: settings come from the job's arguments
    assert set(fresh.error_dict) == set(state.error_dict) and fresh.error_dict
    for index, error in state.error_dict.items():
        assert torch.equal(fresh.error_dict[index], error)
    if mode == "powersgd":
        assert fresh.iter == state.iter == 4
        assert isinstance(state, PowerSGDState) and set(fresh.q_memory_dict) == set(state.q_memory_dict)
        assert fresh.rng.randint(1 << 30) == state.rng.randint(1 << 30)  # the random state continues the same


# ---------------------------------------------------------------------------------------------- topology


def test_nodes_from_hosts_and_from_the_emulation():
    assert topology_from_hosts(["b", "a", "b", "a"]).nodes == (0, 1, 0, 1)
    assert topology_from_hosts(["h"] * 4, emulated_nodes=2).nodes == (0, 0, 1, 1)
    assert topology_from_hosts(["h"] * 4, emulated_nodes=3).nodes == (0, 0, 1, 2)
    two_by_two = Topology((0, 0, 1, 1))
    assert two_by_two.leaders == (0, 2) and two_by_two.node_groups == ((0, 1), (2, 3))
    assert two_by_two.spans_nodes([1, 2]) and not two_by_two.spans_nodes([2, 3])
    with pytest.raises(ValueError, match="asks for more nodes than the job's 2 ranks"):
        topology_from_hosts(["h", "h"], emulated_nodes=3)


@pytest.mark.parametrize(
    ("requested", "nodes", "on", "reason"),
    [
        ("auto", (0, 0, 1, 1), True, "on (auto): 2 nodes"),
        (True, (0, 0, 1, 1), True, "on (hierarchical=True)"),
        (False, (0, 0, 1, 1), False, "off (hierarchical=False)"),
        ("auto", (0, 0, 0, 0), False, "all ranks are on one node"),
        (True, (0, 0), False, "all ranks are on one node"),
        ("auto", (0, 1, 2), False, "every node has one rank"),
        ("auto", (0, 0, 1), True, "on (auto)"),  # uneven nodes: the pair still sends one payload
    ],
)
def test_when_hierarchical_reduction_is_on(requested, nodes, on, reason):
    decided, why = decide_hierarchical(requested, Topology(nodes))
    assert decided is on and reason in why


@pytest.mark.parametrize("value", ["yes", 1, None, "true"])
def test_bad_hierarchical_values(value):
    with pytest.raises(ValueError, match=f"`hierarchical={value!r}` is not one of"):
        check_hierarchical(value)
    assert check_hierarchical("AUTO") == "auto" and check_hierarchical(True) is True


def test_emulation_environment(monkeypatch):
    monkeypatch.setenv(NODES_ENV_VAR, "2")
    monkeypatch.setenv(LINK_ENV_VAR, "1,0.5")
    assert emulated_nodes_from_environment() == 2
    assert slow_link_from_environment() == SlowLink(1.0, 0.5)
    monkeypatch.setenv(LINK_ENV_VAR, "10")
    assert slow_link_from_environment() == SlowLink(10.0, 0.0)
    for bad in ("0", "x", "-1"):
        monkeypatch.setenv(NODES_ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"`{NODES_ENV_VAR}='{bad}'` is not a whole number"):
            emulated_nodes_from_environment()
    for bad in ("0", "fast", "1,-1", "1,2,3"):
        monkeypatch.setenv(LINK_ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"`{LINK_ENV_VAR}='{bad}'` is not a bandwidth"):
            slow_link_from_environment()


def test_link_time_follows_the_busiest_node():
    assert SlowLink(1.0, 2.0).seconds(125_000_000) == pytest.approx(1.002)  # 1 Gbit in 1 s, plus 2 ms
    two_by_two = Topology((0, 0, 1, 1))
    every_rank = dict.fromkeys(range(4), 100.0)
    assert link_crossing_bytes(two_by_two, range(4), every_rank) == 200.0  # flat: two payloads leave each node
    assert link_crossing_bytes(two_by_two, (0, 2), {0: 100.0, 2: 100.0}) == 100.0  # leaders only
    assert link_crossing_bytes(two_by_two, (0, 1), {0: 100.0, 1: 100.0}) == 0.0  # inside a node


# ---------------------------------------------------------------------------------------------- the wire count


def test_who_sends_in_each_collective():
    assert senders("all", (0, 1, 2), None) == (0, 1, 2)
    assert senders("not_dst", (0, 1, 2), 1) == (0, 2)
    assert senders("src", (0, 1, 2), 2) == (2,)


def test_bytes_are_split_into_inside_and_between_nodes():
    meter = WireMeter(1, Topology((0, 0, 1, 1)))
    meter.record((0, 1), (0, 1), 40.0)  # the node's own reduce
    meter.record((0, 1, 2, 3), (0, 1, 2, 3), 100.0)
    meter.record((0, 2), (0, 2), 100.0)  # the leaders' exchange: rank 1 sends nothing
    assert meter.reading() == (40.0, 100.0)


def test_counting_sees_torch_and_restores_it_and_charges_the_link(one_rank_group):
    """One real rank that the meter believes shares the world with a rank on another node: the all-reduce spans
    the link, so it is charged; the collectives are restored afterwards."""
    slept = []
    meter = WireMeter(0, Topology((0, 1)), SlowLink(1.0, 1.0), sleep=slept.append)
    original = dist.all_reduce
    try:
        with meter.counting():
            assert dist.all_reduce is not original
            with meter.counting():  # re-entrant
                dist.all_reduce(torch.zeros(1000))  # 4000 bytes, every rank's: 4000 cross the link from each node
            dist.broadcast(torch.zeros(10), src=0)
            dist.all_gather_into_tensor(torch.zeros(3), torch.zeros(3))  # delegates to all_gather_single: once
        dist.all_reduce(torch.zeros(5))  # not counted outside (the wrappers stay until uninstalled)
    finally:
        meter.uninstall()
    assert dist.all_reduce is original
    assert meter.inter_node_bytes == 4052.0 and meter.intra_node_bytes == 0.0
    assert slept == [
        pytest.approx(1e-3 + 4000 * 8 / 1e9),
        pytest.approx(1e-3 + 40 * 8 / 1e9),
        pytest.approx(1e-3 + 12 * 8 / 1e9),
    ]


def test_the_step_meter_is_told_when_each_blocking_collective_of_a_step_starts_and_ends(one_rank_group):
    """Once per collective (a delegated one once), its emulated link time inside; not outside a step."""
    told = []
    meter = WireMeter(0, Topology((0, 1)), SlowLink(1.0, 1.0), sleep=lambda seconds: told.append("slept"))
    meter.observer = told.append
    try:
        with meter.counting():
            dist.all_reduce(torch.zeros(10))
            dist.all_gather_into_tensor(torch.zeros(3), torch.zeros(3))
        dist.all_reduce(torch.zeros(5))
    finally:
        meter.uninstall()
    assert told == [True, "slept", False, True, "slept", False]


def test_an_asynchronous_collective_in_the_background_pays_the_link_at_its_wait_for_what_is_left(one_rank_group):
    """Inside in_background an overlapped merge's async all-reduce returns at once; its wait sleeps what is left of
    the link's time after the compute done since (on a fake clock); outside, an async collective pays at issue."""
    slept, now = [], [100.0]
    meter = WireMeter(0, Topology((0, 1)), SlowLink(1.0, 1.0), sleep=slept.append, clock=lambda: now[0])
    charge = 1e-3 + 4000 * 8 / 1e9
    try:
        with meter.counting(), meter.in_background():
            work = dist.all_reduce(torch.zeros(1000), async_op=True)
            assert slept == []
            now[0] += 0.4 * charge  # the rank computes while the link carries the bytes
            work.wait()
            assert slept == [pytest.approx(0.6 * charge)]
            late = dist.all_reduce(torch.zeros(1000), async_op=True)
            now[0] += 2 * charge  # computed longer than the link took: nothing left to wait for
            late.wait()
            assert len(slept) == 1
            dist.all_reduce(torch.zeros(1000))  # (a blocking one pays at issue, as always)
        with meter.counting():
            dist.all_reduce(torch.zeros(1000), async_op=True).wait()
    finally:
        meter.uninstall()
    assert slept == [pytest.approx(0.6 * charge), pytest.approx(charge), pytest.approx(charge)]
    assert meter.link_seconds == pytest.approx(4 * charge)


def test_deepspeeds_bound_collectives_are_counted_and_put_back(one_rank_group, monkeypatch):
    """DeepSpeed's backend keeps torch's all_gather_into_tensor and reduce_scatter_tensor as attributes bound at its
    init; the meter must wrap those too (it looked for the backend where DeepSpeed never puts it, and missed them)."""
    import deepspeed.comm.comm as deepspeed_comm

    class Backend:  # what TorchBackend.__init__ keeps
        def __init__(self):
            self.all_gather_function = dist.all_gather_into_tensor
            self.reduce_scatter_function = dist.reduce_scatter_tensor

    backend = Backend()
    gather, scatter = backend.all_gather_function, backend.reduce_scatter_function
    monkeypatch.setattr(deepspeed_comm, "cdb", backend)
    meter = WireMeter(0, Topology((0, 1)), SlowLink(1.0, 1.0), sleep=lambda seconds: None)
    try:
        with meter.counting():
            assert backend.all_gather_function is not gather and backend.reduce_scatter_function is not scatter
            backend.all_gather_function(torch.zeros(3), torch.zeros(3))
    finally:
        meter.uninstall()
    assert backend.all_gather_function is gather and backend.reduce_scatter_function is scatter
    assert meter.inter_node_bytes == 12.0


def test_a_resume_restores_the_hook_state_only_into_the_same_compression_ranks_and_roles():
    facts = {"compression": "topk {'ratio': 0.1}", "hierarchical": True, "nodes": [0, 0, 1, 1]}
    assert compress.restore_blocker(facts, dict(facts), same_world_size=True) is None
    assert "another number of ranks" in compress.restore_blocker(facts, facts, same_world_size=False)
    assert "has none" in compress.restore_blocker(None, facts, same_world_size=True)
    for key, other in (("compression", "powersgd"), ("hierarchical", False), ("nodes", [0, 1, 0, 1])):
        reason = compress.restore_blocker(facts, {**facts, key: other}, same_world_size=True)
        assert reason is not None and key in reason


def test_where_hierarchical_cannot_apply():
    own_state = compress.check_compression((default_hooks.allreduce_hook, object()))
    assert "its own state" in compress.hierarchical_blocker(own_state, {})
    assert compress.hierarchical_blocker(compress.check_compression(default_hooks.allreduce_hook), {}) is None
    wire_dtype = {"communication_data_type": "fp16"}
    assert "communication_data_type" in compress.hierarchical_blocker(compress.CompressionChoice(), wire_dtype)
    with pytest.raises(ValueError, match="`hierarchical=True` cannot apply: a custom hook given with its own state"):
        compress.check_exchange(own_state, True, 0)
    compress.check_exchange(own_state, "auto", 0)  # "auto" stays flat instead (decided at setup)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"deepspeed_fp16": True}, "DeepSpeed's own mixed precision is on"),
        ({"deepspeed_bf16": True}, "DeepSpeed's own mixed precision is on"),
        ({"torch_autocast": True}, "DeepSpeed's own mixed precision is on"),
        ({"moe": True}, "MoE layers"),
        ({"averages": False}, "`gradient_allreduce_op` to sum"),
    ],
)
def test_deepspeed_modes_a_hooked_exchange_would_get_wrong_are_refused(flags, message):
    plain = {"deepspeed_fp16": False, "deepspeed_bf16": False, "torch_autocast": False, "moe": False, "averages": True}
    compress.check_hookable("compression powersgd", **plain)
    with pytest.raises(ValueError, match="compression powersgd replaces DeepSpeed's gradient exchange, but"):
        compress.check_hookable("compression powersgd", **{**plain, **flags})
    with pytest.raises(ValueError, match=message):
        compress.check_hookable("compression powersgd", **{**plain, **flags})


def test_scalar_and_empty_parameters_and_a_freeze_during_training(one_rank_group):
    """0-dim parameters travel as (1,) (PowerSGD reads shape[0]); empty ones not at all; a parameter frozen between
    steps leaves the exchange and the per-bucket state is dropped, on every rank alike."""
    scale, empty, weight = (
        torch.nn.Parameter(torch.tensor(2.0)),
        torch.nn.Parameter(torch.zeros(0)),
        torch.nn.Parameter(torch.zeros(8, 8)),
    )
    choice = compress.check_compression("powersgd", {"start_powerSGD_iter": 2})
    hook, bounded = compress.builtin_hook(choice, None)
    exchange = HookedExchange([scale, empty, weight], hook, bounded, cap_bytes=4)  # one bucket per parameter
    state = bounded.inner_state  # (PowerSGD's, inside the error bound's)
    for _ in range(3):
        scale.grad, weight.grad = torch.tensor(0.5), torch.randn(8, 8)
        exchange()
    assert [[p.numel() for p in bucket] for bucket in exchange.buckets] == [[1], [64]]
    assert scale.grad.shape == () and state.error_dict  # compressed (step 3), with error feedback
    weight.requires_grad_(False)
    exchange()
    assert [[p.numel() for p in bucket] for bucket in exchange.buckets] == [[1]]
    assert {index: error.numel() for index, error in state.error_dict.items()} == {0: 1}  # the old buckets' are gone
    assert set(bounded.shapes) == {0}  # and the bound's byte budget counts the new buckets only


def test_a_hook_may_replace_the_buffer_as_with_ddp(one_rank_group):
    """torch's fp16_compress_wrapper hands the inner hook an fp16 buffer through set_buffer."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

    model = torch.nn.Linear(4, 3)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 1 / 3)
    seen = []

    def recording_hook(state, bucket):
        seen.append(bucket.buffer().dtype)
        return default_hooks.allreduce_hook(state, bucket)

    HookedExchange(list(model.parameters()), fp16_compress_wrapper(recording_hook), None)()
    assert seen == [torch.float16]
    assert model.weight.grad.dtype == torch.float32
    assert torch.allclose(model.weight.grad, torch.full_like(model.weight, 1 / 3), atol=1e-3)


def test_an_emulated_slow_sender_holds_its_payload_back_before_the_collective_is_issued(one_rank_group):
    """`emulate_slowdown="sends"`: before each collective of a step in which this rank sends, it sleeps what a link of
    its speed times the reference bandwidth takes longer for its payload, then issues it (the others wait inside);
    nothing for a reduce to it (it sends nothing there), nor outside a step."""
    from lightning_hetero.emulate.emulation import SendsEmulation, send_hold_seconds
    from lightning_hetero.emulate.slowdown import speed_schedule

    assert send_hold_seconds(1e6, 0.25, 1.0) == pytest.approx(3 * 8e6 / 1e9)  # 24 ms more for 1 MB at 1/4
    assert send_hold_seconds(1e6, 1.0, 1.0) == 0.0
    emulation = SendsEmulation(speed_schedule({0: [1.0, 0.5], 10: [1.0, 1.0]}), 1, 1.0)
    assert emulation.send_seconds(4000) == pytest.approx(4000 * 8 / 1e9)  # (1/0.5 - 1) x 4000 bytes at 1 Gbit/s
    emulation.at_step(10)
    assert emulation.send_seconds(4000) == 0.0  # (the drift schedule's speed 1 from step 10)

    told = []
    meter = WireMeter(0, Topology((0,)), sleep=lambda seconds: told.append(("slept", seconds)))
    meter.observer = told.append
    meter.send_hold = lambda payload: payload * 1e-6
    try:
        with meter.counting():
            dist.all_reduce(torch.zeros(10))  # 40 bytes
            dist.reduce(torch.zeros(10), dst=0)  # (its destination sends nothing)
        dist.all_reduce(torch.zeros(5))
    finally:
        meter.uninstall()
    assert told == [("slept", pytest.approx(40e-6)), True, False, True, False]
    assert meter.send_held_seconds == pytest.approx(40e-6)
