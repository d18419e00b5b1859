"""Quantized pseudo-gradients (lightning_hetero.comm.quantize) and the quantized merge of LocalTraining."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from lightning_hetero.comm.quantize import BLOCK, dequantize, largest_level, quantize, wire_bytes
from lightning_hetero.local.merges import LocalTraining


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000])
def test_each_value_comes_back_within_half_a_step_of_its_block(bits, numel):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    payload, scales = quantize(values, bits)
    back = dequantize(payload, scales, bits, numel)
    assert back.shape == values.shape and back.dtype == torch.float32
    blocks = -(-numel // BLOCK)
    assert scales.numel() == blocks and payload.dtype == torch.uint8
    assert payload.numel() + 4 * scales.numel() == wire_bytes(numel, bits)
    step = scales.repeat_interleave(BLOCK)[:numel]  # each value's block scale: one integer step
    assert torch.all((values - back).abs() <= step / 2 + 1e-6)
    # The block's largest magnitude is sent exactly (it sets the scale).
    first = values[: min(numel, BLOCK)]
    largest = first.abs().argmax()
    assert back[largest].item() == pytest.approx(first[largest].item(), rel=1e-6)


def test_int4_packs_two_levels_to_a_byte_and_keeps_the_sign():
    values = torch.tensor([-7.0, -1.0, 0.0, 1.0, 7.0, 3.0])
    payload, scales = quantize(values, 4, block=6)
    assert payload.numel() == 3 and scales.tolist() == [1.0]
    assert torch.equal(dequantize(payload, scales, 4, 6, block=6), values)
    assert largest_level(4) == 7 and largest_level(8) == 127


def test_an_all_zero_block_sends_zeros_and_a_zero_scale():
    values = torch.cat([torch.zeros(BLOCK), torch.ones(10)])
    payload, scales = quantize(values, 8)
    assert scales[0].item() == 0.0
    assert torch.equal(dequantize(payload, scales, 8, values.numel()), values)


def test_bytes_are_a_quarter_and_an_eighth_of_fp32_plus_the_scales():
    numel = 1_000_000
    assert wire_bytes(numel, 8) / (4 * numel) < 0.27
    assert wire_bytes(numel, 4) / (4 * numel) < 0.14


def test_unsupported_bits_are_refused():
    with pytest.raises(ValueError, match="bits=2"):
        quantize(torch.ones(4), 2)


class ThreadGather:
    """Every rank's tensor in rank order, for ranks that are threads of this process (one call per rank per round)."""

    def __init__(self, ranks: int) -> None:
        self.barrier = threading.Barrier(ranks, timeout=10)
        self.slots: list = [None] * ranks

    def for_rank(self, rank: int):
        def gather(tensor):
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            gathered = list(self.slots)
            self.barrier.wait()
            return gathered

        return gather


def on_two_threads(body, timeout: float = 30) -> None:
    """``body(rank)`` on two threads, the two ranks; a failure in either is raised here."""
    errors: list[BaseException] = []

    def run(rank):
        try:
            body(rank)
        except BaseException as error:  # (a failed assertion in a thread would otherwise pass silently)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not errors, errors


def merge_on_two_threads(trainings, parameters, gather: ThreadGather, all_reduce):
    on_two_threads(lambda rank: trainings[rank].synchronize(all_reduce(rank), gather.for_rank(rank)), timeout=20)


class SumOfTwo:
    """An all-reduce (sum) of two threads' tensors, in place."""

    def __init__(self) -> None:
        self.gather = ThreadGather(2)

    def __call__(self, rank: int):
        gather = self.gather.for_rank(rank)

        def all_reduce(tensor):
            total = sum(part.double() for part in gather(tensor))
            tensor.copy_(total.to(tensor.dtype))

        return all_reduce


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_merge_leaves_every_rank_the_same_parameters_near_the_fp32_merge(mode):
    """Two ranks (threads) with different deltas and samples 3 and 1: after the merge both hold the same parameters,
    bit for bit, within the quantization's step of the fp32 merge; each rank keeps what rounding left out."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(300, generator=generator), torch.randn(7, 5, generator=generator)]
    moved = [[p - 0.1 * torch.randn(p.shape, generator=generator) for p in start] for _ in range(2)]

    def ranks(compression):
        trainings, parameters = [], []
        for rank in range(2):
            own = [torch.nn.Parameter(p.clone()) for p in start]
            training = LocalTraining("local_sgd", 1, None, compression)
            training.attach(own, None)
            with torch.no_grad():
                for parameter, value in zip(own, moved[rank]):
                    parameter.copy_(value)
            training.samples_since_sync, training.steps_since_sync = [3, 1][rank], 1
            trainings.append(training)
            parameters.append(own)
        merge_on_two_threads(trainings, parameters, ThreadGather(2), SumOfTwo())
        return trainings, parameters

    _, exact = ranks(None)
    trainings, quantized = ranks(mode)
    for a, b in zip(quantized[0], quantized[1]):
        assert torch.equal(a, b)
    step = max(
        moved_delta.abs().max().item()
        for moved_delta in [torch.cat([(s - m).reshape(-1) for s, m in zip(start, moved[r])]) for r in range(2)]
    ) / largest_level(8 if mode == "int8" else 4)
    difference = max((q - e).abs().max().item() for q, e in zip(quantized[0], exact[0]))
    assert 0 < difference <= step
    for training in trainings:
        assert training.error_feedback is not None and training.error_feedback.abs().max().item() <= step / 2 + 1e-6
        assert training.state()["error_feedback"] is training.error_feedback


def test_error_feedback_sends_what_rounding_left_at_the_next_merge():
    """One rank, the same delta at every merge: the sum of what was sent over the merges plus what is left equals the
    sum of the deltas (nothing is lost, only late), and what is left stays under half a step."""
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 1e-3
    parameter = torch.nn.Parameter(torch.zeros(1000))
    training = LocalTraining("local_sgd", 1, None, "int4")
    training.attach([parameter], None)
    sent = torch.zeros(1000, dtype=torch.float64)
    for _ in range(20):
        anchor = parameter.detach().clone()
        with torch.no_grad():
            parameter.sub_(delta)  # anchor - parameters = delta
        training.samples_since_sync = training.steps_since_sync = 1
        training.synchronize(lambda tensor: None, lambda tensor: [tensor])
        sent += (anchor - parameter.detach()).double()  # what the merge applied
    total = 20 * delta.double()
    assert torch.allclose(sent + training.error_feedback.double(), total, atol=1e-6)
    assert training.error_feedback.abs().max().item() <= delta.abs().max().item() / 7  # one int4 step of a block


def test_a_merge_before_a_checkpoint_leaves_a_fragment_just_merged_alone():
    """Streaming DiLoCo (outer momentum 0.9), 2 fragments, sync_every 2, one rank: after step 2 fragment 1 has just
    merged and fragment 0 trained a step since its merge at step 1. The merge a checkpoint asks for merges fragment 0
    only: merging fragment 1 again would move it by the outer momentum alone."""
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
    parameters = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))]
    training = LocalTraining("diloco", 2, outer, None, fragments=2)
    training.attach(parameters, None)
    merged_steps = []
    for _ in range(2):
        with torch.no_grad():
            for parameter in parameters:
                parameter.sub_(0.1)  # a training step moves every tensor
        if training.step_done(1, False, lambda tensor: None):
            merged_steps.append(training.steps_done)
    assert merged_steps == [1, 2] and training.steps_since_sync == 1
    just_merged = parameters[1].detach().clone()
    before = parameters[0].detach().clone()
    training.synchronize(lambda tensor: None)
    assert torch.equal(parameters[1].detach(), just_merged)
    assert not torch.equal(parameters[0].detach(), before) and training.steps_since_sync == 0
    assert training.synchronizations == 3


def test_a_non_finite_delta_is_merged_as_fp32_would_and_not_kept_in_the_error_feedback():
    """An inf in one rank's delta reaches the merge (as an fp32 all-reduce would carry it; the non-finite guard stops
    the run), but what rounding left for the next merge stays finite."""
    parameter = torch.nn.Parameter(torch.zeros(300))
    training = LocalTraining("local_sgd", 1, None, "int8")
    training.attach([parameter], None)
    with torch.no_grad():
        parameter[5] = -math.inf
        parameter[260:] = -0.01
    training.samples_since_sync = training.steps_since_sync = 1
    training.synchronize(lambda tensor: None, lambda tensor: [tensor])
    assert not torch.isfinite(parameter.detach()[:256]).all()
    assert torch.isfinite(training.error_feedback).all()


def test_error_feedback_of_another_model_is_refused_at_load(tmp_path):
    saved = LocalTraining("local_sgd", 1, None, "int8")
    saved.attach([torch.nn.Parameter(torch.zeros(10))], None)
    saved.error_feedback = torch.ones(10)
    saved.save(tmp_path, 0)
    other = LocalTraining("local_sgd", 1, None, "int8")
    other.attach([torch.nn.Parameter(torch.zeros(12))], None)
    with pytest.raises(ValueError, match="error feedback for 10 parameter values, and the model trains 12"):
        other.load(tmp_path, 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh there)")
@pytest.mark.parametrize("compression", [None, "int8"])
def test_a_merge_of_cuda_parameters_stays_on_the_gpu(compression):
    """The counts, the deltas and the merged parameters on the parameters' device (NCCL reduces CUDA tensors only);
    a quantized merge's error feedback on the CPU, as it is saved."""
    parameter = torch.nn.Parameter(torch.zeros(300, device="cuda"))
    training = LocalTraining("local_sgd", 1, None, compression)
    training.attach([parameter], None)
    with torch.no_grad():
        parameter.sub_(0.5)
    devices = []

    def all_reduce(tensor):
        devices.append(tensor.device.type)

    training.samples_since_sync = training.steps_since_sync = 1
    training.synchronize(all_reduce, lambda tensor: [tensor.cpu()])
    assert parameter.device.type == "cuda" and torch.allclose(parameter.detach().cpu(), torch.full((300,), -0.5))
    assert set(devices) == {"cuda"}
    if compression:
        assert training.error_feedback.device.type == "cpu"
