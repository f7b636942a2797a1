"""Weight formats: int8 per output channel, and int4 in groups with two values per byte.

A number format is a grid of values a few bits can name. Quantizing a weight matrix means
choosing, for a slice of it, a grid that covers that slice's values, and storing for each weight
the index of the nearest grid point. The grid itself costs a few numbers per slice (its step, the
*scale*, and where it starts); the smaller the slice, the better the grid fits and the more those
few numbers cost.

int8, symmetric, one scale per output channel
---------------------------------------------
Row ``n`` of a linear layer's weight ``W [out_features, in_features]`` produces output ``n``. Its
grid is ``scale_n * {-127, ..., 127}`` with ``scale_n = max|W[n]| / 127``: symmetric (weights sit
around zero, so zero stays exact and no offset is needed) and as wide as the row's largest weight.
Rounding to the nearest point errs by at most ``scale_n / 2``. One float32 scale per row of
576..1536 weights costs under 1 % extra: 8.02..8.06 bits per weight.

A per-row scale also factors out of the matmul: ``x @ (q * s).T == (x @ q.T) * s``, so a kernel
can multiply by the integer matrix and scale each output once at the end.

int4, asymmetric, one scale and one minimum per group of the input dimension
----------------------------------------------------------------------------
With only 16 grid points a whole row is too coarse: one large weight stretches the grid for all
the others. So each row is cut into groups of ``group_size`` consecutive weights (32, 64 or 128
along the input dimension), and each group gets its own grid from its own minimum to maximum:

    scale = (max - min) / 15        q = round((w - min) / scale)  in 0..15        w ~ q * scale + min

This is *asymmetric* (zero-point) quantization: a group whose weights are mostly positive uses
all 16 points instead of wasting half of them below zero. Written the textbook way,
``w ~ (q - z) * scale`` with zero point ``z = -min / scale``; we store ``min`` itself (as GGUF's
Q4_1 does), which is the same grid and lets the kernels compute ``q * scale + min`` with one
multiply-add. Scale and minimum are float16 (2 bytes each): with float32 they would cost 8 bytes
per group, and int4 g64 would shrink bfloat16 weights 3.2x instead of 3.6x.

Two 4-bit values share a byte: input column ``2i`` in the low nibble, ``2i + 1`` in the high.
"""
from __future__ import annotations

import torch

INT8_QMAX = 127
INT4_LEVELS = 15  # q in 0..15
INT4_GROUP_SIZES = (32, 64, 128)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q int8 [out, in], scale float32 [out]) with w ~= q * scale[:, None].

    |w - q * scale| <= scale / 2 everywhere; an all-zero row gets scale 0 and stores zeros.
    """
    w = w.float()
    scale = w.abs().amax(dim=1) / INT8_QMAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # 0 / 1 = 0: an all-zero row stays zero
    q = torch.round(w / safe[:, None]).clamp(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix an int8 weight stands for: q * scale[:, None]."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not divisible by the int4 group_size {group_size}: "
                         f"pick a group size from {INT4_GROUP_SIZES} that divides it")


def quantize_int4_groupwise(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8 [out, in] in 0..15, scale float16 [out, in // group_size], min float16 [same]).

    w[n, k] ~= q[n, k] * scale[n, g] + min[n, g] with g = k // group_size, within scale / 2 (plus
    float16 rounding of scale and min, a relative 2^-11). The grid is computed from the float16
    scale and min actually stored, so reading back uses exactly the grid that was rounded to.
    """
    out_features, in_features = w.shape
    check_group_size(in_features, group_size)
    groups = w.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / INT4_LEVELS).to(torch.float16)
    minimum = low.to(torch.float16)
    q = round_to_int4_grid(groups, scale[..., None], minimum[..., None])
    return q.reshape(out_features, in_features), scale, minimum


def round_to_int4_grid(w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The nearest point of the grid q * scale + min, q in 0..15, for each weight (scale, min broadcast to w).

    Values outside the grid's range go to its ends (GPTQ meets them: the error it pushes onto later
    columns can carry them past the range their group's grid was fitted to).
    """
    # A constant group has scale 0: every weight is its minimum (q = 0 reproduces it exactly).
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    return torch.round((w.float() - minimum.float()) / safe).clamp(0, INT4_LEVELS).to(torch.uint8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [out, in] with values 0..15 (in even) -> [out, in // 2]: column 2i low nibble, 2i+1 high."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {q.shape[-1]}")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: [out, in // 2] uint8 -> [out, in] uint8 in 0..15."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix a packed int4 weight stands for: q * scale + min, group by group."""
    q = unpack_int4(packed).float()
    out_features, in_features = q.shape
    group_size = in_features // scale.shape[1]
    groups = q.reshape(out_features, -1, group_size) * scale.float()[..., None] + minimum.float()[..., None]
    return groups.reshape(out_features, in_features).to(dtype)
