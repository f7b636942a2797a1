"""An int8 KV cache: each cached key and value vector stored as int8 numbers and one scale.

Why the KV cache first
----------------------
During decoding, every step reads every cached K and V byte of every sequence, and the cache,
not the weights, is what limits how many sequences fit beside each other. Halving its bytes
(int8 instead of bfloat16; a quarter of float32) doubles the tokens a memory budget holds, and
halves the bytes a memory-bound decode step must read.

Absmax, symmetric
-----------------
A vector ``x`` of ``head_dim`` numbers becomes ``round(x / scale)``, integers in [-127, 127], with

    scale = max(|x|) / 127

so the largest entry maps to ±127 and zero stays exactly zero (no zero point: keys and values
sit around zero, so a symmetric grid wastes little). Reading back is ``q * scale``. Rounding to
the nearest integer means every entry comes back within half a step: ``|x - q * scale| <= scale / 2``.
(We round halves away from zero, which the Triton kernels can do with one add and one cast.)

Why one scale per (token, KV head)
----------------------------------
The cache grows one token at a time, and a token's K and V never change once written. With a
scale per token (and head), writing a new token computes its own scale from its own numbers
and touches nothing else. A scale shared over many tokens (a whole block, a whole layer) would
have to grow when a larger number arrives, and every entry already stored under the old scale
would need re-quantizing. Heads differ in magnitude, so they get separate scales too; a scale
per head_dim numbers costs 4 bytes per 64, about 6 %.

Why the scales are float32
--------------------------
A bfloat16 scale would save 2 of those 4 bytes, but bfloat16 keeps only 8 significant bits: the
scale itself would be off by up to 0.4 %, moving the largest entries by as much as the int8
rounding does and doubling the worst-case error. float32 scales keep the error at the int8
step alone, and the kernels read one dtype whatever the model's.
"""
from __future__ import annotations

import torch

QMAX = 127  # symmetric: -127..127, leaving -128 unused so that q and -q are both representable


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K or V vectors along their last axis (head_dim).

    x [..., head_dim] in any float dtype -> (q int8 [..., head_dim], scale float32 [...]) with
    x ~= q * scale[..., None]. An all-zero vector gets scale 0 and stores zeros.
    """
    x = x.float()
    scale = x.abs().amax(dim=-1) / QMAX
    scaled = x / torch.where(scale == 0, 1.0, scale)[..., None]
    # round half away from zero: add ±0.5, then the cast truncates toward zero
    q = (scaled + torch.where(scaled >= 0, 0.5, -0.5)).to(torch.int8)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of ``quantize_kv``: q int8 [..., head_dim], scale [...] -> q * scale in ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def kv_vector_bytes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one cached (token, KV head) vector: head_dim values of the model's dtype ("auto"),
    or head_dim int8 values and their float32 scale ("int8")."""
    if kv_cache_dtype == "auto":
        return head_dim * dtype.itemsize
    if kv_cache_dtype == "int8":
        return head_dim + 4
    raise ValueError(f"kv_cache_dtype must be 'auto' (the model's dtype) or 'int8', got {kv_cache_dtype!r}")
