"""Chapter 06, worked: quantization, from one weight matrix to the KV cache."""
from __future__ import annotations

import torch


# -------------------- int8, per output channel


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output channel (row) of w [out, in].

    scale[n] = max_k |w[n, k]| / 127 (float32, shape [out]); q = round(w / scale), clamped to
    [-127, 127], as int8 [out, in]. A row of zeros gets scale 0 and q = 0 (no division by zero).
    Afterwards |w - q * scale[:, None]| <= scale / 2 everywhere (up to float32 rounding).
    """
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # a zero row: 0 / 1 = 0
    q = torch.round(w / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix q * scale[:, None] that int8 codes q [out, in] and scales [out] stand for."""
    return q.float() * scale.float()[:, None]


# -------------------- int4, in groups, two per byte


def quantize_int4_groupwise(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of group_size consecutive inputs of each row of w [out, in].

    Group g of row n covers w[n, g*group_size : (g+1)*group_size]. With lo, hi its min and max:
    scale = (hi - lo) / 15, minimum = lo (both float32 and unrounded: the engine's float16 storage is a
    later step; shape [out, in // group_size]), and q = round((w - minimum) / scale) clamped to 0..15,
    as uint8 [out, in]. A constant group has
    scale 0 and q = 0. Raise ValueError if in is not a multiple of group_size.
    """
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")
    groups = w.float().reshape(out_features, in_features // group_size, group_size)
    minimum = groups.amin(dim=-1)
    scale = (groups.amax(dim=-1) - minimum) / 15
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # a constant group: every q is 0
    q = torch.round((groups - minimum[..., None]) / safe[..., None]).clamp(0, 15)
    return q.to(torch.uint8).reshape(out_features, in_features), scale, minimum


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte: q uint8 [out, in] (values 0..15; in, the number of columns, is even)
    -> uint8 [out, in // 2].

    Byte i of a row holds column 2i in its low nibble and column 2i + 1 in its high nibble.
    """
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [out, in // 2] -> uint8 [out, in], values 0..15."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)  # low, high, low, high, ...


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 matrix [out, in] a packed int4 weight stands for: q * scale + minimum per group."""
    q = unpack_int4(packed).float()
    out_features, in_features = q.shape
    groups = q.reshape(out_features, in_features // group_size, group_size)
    return (groups * scale[..., None] + minimum[..., None]).reshape(out_features, in_features)


# -------------------- the KV cache in int8


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 KV-cache entries: one symmetric absmax scale per (token, head).

    x [tokens, heads, head_dim] (keys or values) -> (q int8 [tokens, heads, head_dim],
    scale float32 [tokens, heads]) with scale = max |x| / 127 over head_dim and q = round(x / scale)
    clamped to [-127, 127]. An all-zero vector gets scale 0 and stores zeros. Each token's scale
    depends on that token alone, so writing a new token never touches the ones already stored.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_kv_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Read int8 KV entries back: q [tokens, heads, head_dim] * scale[..., None] -> float32."""
    return q.float() * scale.float()[..., None]
