"""NF4, QLoRA's 4-bit NormalFloat (Dettmers et al., 2023): 16 levels where normal weights are dense.

int4 (``minfer.formats.weights``) spaces its 16 levels evenly between a group's minimum and
maximum. But trained weights are roughly normal: most sit near zero, few far out. NF4 puts its
16 levels at quantiles of the standard normal, so each level is used about equally often:

    levels = [-1, -0.696, -0.525, -0.395, -0.284, -0.185, -0.091, 0, 0.080, 0.161, 0.246, 0.338,
              0.441, 0.563, 0.723, 1]

Built the way the paper builds them: 8 positive levels at the normal quantiles of 8 equal steps
from probability 0.5 to ``OFFSET`` = 0.9677 (a tail probability chosen so the outermost level is
not infinite), 7 negative ones at 7 steps on the other side, and an exact zero; all divided by
the largest, so they span [-1, 1]. The asymmetry (8 above zero, 7 below) keeps zero exact.

Scale: symmetric, one *absmax* per block of ``block_size`` consecutive inputs (64, QLoRA's
choice): ``w ~ levels[q] * absmax``. Stored as float16 (QLoRA goes further and quantizes the
absmax values themselves to 8 bits, "double quantization"; we do not), so NF4 with blocks of 64
costs 4 + 16/64 = 4.25 bits per weight, against int4 g64's 4 + 32/64 = 4.5 (scale and minimum).
Codes are packed two per byte as int4's are (``pack_int4``).

Rounding goes to the nearest level, found by comparing with the midpoints between levels; the
error is at most half the widest gap (between -1 and -0.696: 0.152 of the absmax).
"""
from __future__ import annotations

import functools

import torch

from minfer.formats.weights import pack_int4, unpack_int4

NF4_OFFSET = 0.9677083  # QLoRA's: the mean of the two choices (1 - 1/(2*15), 1 - 1/(2*16)) for the tail
NF4_BLOCK_SIZES = (32, 64, 128)
NF4_BLOCK_SIZE = 64


def nf4_levels() -> torch.Tensor:
    """The 16 NF4 levels (float32, ascending, from -1 to 1 with an exact 0) from normal quantiles."""
    normal_quantile = lambda p: torch.special.ndtri(torch.tensor(p, dtype=torch.float64))
    positive = normal_quantile(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1].tolist())
    negative = -normal_quantile(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1].tolist())
    levels = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return (levels / levels.max()).float()


NF4_LEVELS = nf4_levels()


def check_block_size(in_features: int, block_size: int) -> None:
    if block_size not in NF4_BLOCK_SIZES:
        raise ValueError(f"nf4 block_size must be one of {NF4_BLOCK_SIZES}, got {block_size!r}")
    if in_features % block_size:
        raise ValueError(f"in_features {in_features} is not divisible by the nf4 block_size {block_size}: "
                         f"pick a block size from {NF4_BLOCK_SIZES} that divides it")


def quantize_nf4(w: torch.Tensor, block_size: int = NF4_BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (packed codes uint8 [out, in // 2], absmax float16 [out, in // block_size]).

    w[n, k] ~= NF4_LEVELS[q[n, k]] * absmax[n, k // block_size]. The codes are rounded against the
    float16 absmax actually stored. An all-zero block gets absmax 0 and reads back as zeros.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_nf4 takes a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out_features, in_features = w.shape
    check_block_size(in_features, block_size)
    blocks = w.float().reshape(out_features, in_features // block_size, block_size)
    absmax = blocks.abs().amax(dim=-1).to(torch.float16)
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax).float()
    q = round_to_nf4(blocks / safe[..., None])
    return pack_int4(q.reshape(out_features, in_features)), absmax


@functools.lru_cache(maxsize=None)
def levels_on(device: torch.device) -> torch.Tensor:
    """NF4_LEVELS on a device, copied there once (a copy on every call would wait for the GPU each time)."""
    return NF4_LEVELS.to(device)


def round_to_nf4(x: torch.Tensor) -> torch.Tensor:
    """The index (uint8, 0..15) of the NF4 level nearest to each value of x (already divided by absmax)."""
    levels = levels_on(x.device)
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(x.float().contiguous(), midpoints).to(torch.uint8)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix [out, in] NF4 codes stand for: NF4_LEVELS[q] * absmax, block by block."""
    q = unpack_int4(packed)
    out_features, in_features = q.shape
    block_size = in_features // absmax.shape[1]
    values = levels_on(packed.device)[q.long()].reshape(out_features, -1, block_size)
    return (values * absmax.float()[..., None]).reshape(out_features, in_features).to(dtype)
