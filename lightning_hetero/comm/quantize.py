"""Quantized pseudo-gradients: ``compression="int8"`` or ``"int4"`` with ``sync="local_sgd"`` or ``"diloco"``.

A merge sends each rank's weighted delta in blocks of :data:`BLOCK` values, each block as signed integers of 8 or 4
bits (two 4-bit values to a byte) and one fp32 scale, its largest magnitude over the integers' largest (127 or 7):
about 1/4 (int8) or 1/8 (int4) of fp32's bytes, plus 4 bytes a block (1/64 of fp32's at 256 values a block). What
rounding lost is this rank's error feedback: added to its next merge's delta, so nothing is lost for good, only late
(as INTELLECT-1 and SparseLoCo do). Integers cannot be summed on the wire without overflow, so the ranks gather each
other's blocks and scales and each sums the dequantized deltas in rank order: the same sum, bit for bit, on every
rank, so the parameters stay the same everywhere. A rank then receives every other rank's blocks: with W ranks,
(W - 1) times its own, against about 2 (W - 1) / W of fp32's for a ring all-reduce, so int8 sends fewer bytes than
fp32 up to about 8 ranks and int4 up to about 16 (a quantized reduce-scatter would lift that; not built).

Pure tensor functions; :class:`lightning_hetero.local.merges.LocalTraining` calls them at a merge.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 256  # values per scale (even: two 4-bit values share a byte)
BITS = {"int8": 8, "int4": 4}


def largest_level(bits: int) -> int:
    """The largest magnitude a signed integer of ``bits`` carries here (symmetric: 127 or 7)."""
    return 2 ** (bits - 1) - 1


def quantize(values: Tensor, bits: int, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """``values`` (1-D, fp32) as (payload: uint8 bytes, scales: fp32, one per block). The last block is padded with
    zeros; :func:`dequantize` needs the number of values back."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: only 8 and 4 are supported")
    levels = largest_level(bits)
    blocks = -(-values.numel() // block)
    padded = F.pad(values.float(), (0, blocks * block - values.numel())).view(blocks, block)
    scales = padded.abs().amax(dim=1) / levels
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block sends zeros
    integers = torch.round(padded / divisors[:, None]).clamp_(-levels, levels).to(torch.int16).reshape(-1)
    if bits == 8:
        return integers.to(torch.int8).view(torch.uint8), scales
    nibbles = (integers + 8).to(torch.uint8)  # -7..7 as 1..15
    return nibbles[0::2] | (nibbles[1::2] << 4), scales


def dequantize(payload: Tensor, scales: Tensor, bits: int, numel: int, block: int = BLOCK) -> Tensor:
    """The ``numel`` fp32 values that :func:`quantize` encoded, as the integers times their block's scale."""
    if bits == 8:
        integers = payload.view(torch.int8).to(torch.float32)
    else:
        low = (payload & 0x0F).to(torch.int16) - 8
        high = (payload >> 4).to(torch.int16) - 8
        integers = torch.stack((low, high), dim=1).reshape(-1).to(torch.float32)
    return (integers.view(-1, block) * scales[:, None]).reshape(-1)[:numel]


def quantize_with_feedback(
    values: Tensor, feedback: Tensor, ranges: Sequence[tuple[int, int]], bits: int
) -> tuple[Tensor, Tensor]:
    """``values`` (the model's values in ``ranges`` of ``feedback``, concatenated) with what rounding left out of them
    before added, :func:`quantize`d; what this rounding leaves out replaces ``feedback`` in those ranges."""
    values = values + torch.cat([feedback[begin:end] for begin, end in ranges])
    payload, scales = quantize(values, bits)
    # (a non-finite value makes its block's scale non-finite; the merge carries it as fp32 would, but what is left
    # for the next merge must not carry it on for good)
    left = torch.nan_to_num(values - dequantize(payload, scales, bits, values.numel()), 0.0, 0.0, 0.0)
    offset = 0
    for begin, end in ranges:
        feedback[begin:end] = left[offset : offset + end - begin]
        offset += end - begin
    return payload, scales


def wire_bytes(numel: int, bits: int, block: int = BLOCK) -> int:
    """Bytes one rank sends for ``numel`` values: the payload and the scales."""
    blocks = -(-numel // block)
    return blocks * block * bits // 8 + blocks * 4
