"""KV cache formats: int8 (each cached key and value vector as int8 numbers and one scale), and fp8.

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

fp8 (e4m3): a float format, so one scale per (layer, KV head)
-------------------------------------------------------------
``kv_cache_dtype="fp8"`` (vLLM's name; also "fp8_e4m3") stores ``torch.float8_e4m3fn``: a sign,
4 exponent bits and 3 mantissa bits, finite numbers up to ±448. Being a float, it keeps the same
*relative* precision at every magnitude (a step of 2^-3 of the number, so at most 6.25 % off
after rounding to nearest) from 2^-6 up to 448; below 2^-6 the steps stop shrinking (subnormals,
a fixed 2^-9). A scale therefore only has to place a head's numbers inside that range; it does
not buy precision the way int8's does. That is why fp8 needs no scale per token: one float32
scale per (layer, KV head), for K and for V, is enough, and a cached vector costs head_dim bytes,
exactly half of bfloat16 (int8 needs 4 more per vector for its scale).

The scale is static: the cache grows a token at a time, and a scale that changed later would
invalidate everything stored under it (the argument for int8's per-token scales, above). It is
calibrated once, when the engine is built, on a short calibration text (kept apart from the
evaluation text): ``scale = FP8_HEADROOM * max|x| / 448`` per (layer, KV head), so numbers up to
FP8_HEADROOM times the largest ever seen still fit. The headroom costs almost nothing in a float
format: it only moves the bottom of the range up (numbers below ``scale * 2^-6`` lose relative
precision), and for SmolLM2-135M (keys up to ~20, values up to ~15) that bottom stays far below
the numbers that matter. Anything beyond ±448 after scaling saturates to ±448 (never inf or NaN).
Why per KV head and not one per tensor: the kernels read it once per program (each program
serves one KV head), so it costs the same, and heads differ (SmolLM2's layer-0 values reach
0.4-0.6, later layers' 15). e5m2 (more range, 2 mantissa bits) is not implemented: with a scale,
range is not what an fp8 KV cache lacks, precision is.
"""
from __future__ import annotations

import torch

QMAX = 127  # symmetric: -127..127, leaving -128 unused so that q and -q are both representable
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_HEADROOM = 4.0  # an fp8 scale leaves room for numbers up to 4x the calibrated maximum
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")  # vLLM's names; "fp8" is e4m3, as in vLLM


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The cache format's canonical name ("auto", "int8" or "fp8"), or a ValueError naming the allowed ones."""
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return "fp8" if kv_cache_dtype == "fp8_e4m3" else kv_cache_dtype
    why = ": e5m2 is not implemented, fp8 here is e4m3" if kv_cache_dtype == "fp8_e5m2" else ""
    raise ValueError(f"kv_cache_dtype must be 'auto' (the model's dtype), 'int8' or 'fp8' (= 'fp8_e4m3'), "
                     f"got {kv_cache_dtype!r}{why}")


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
    """The inverse of ``quantize_kv`` (and of ``quantize_kv_fp8``): q int8 or fp8 [..., head_dim],
    scale [...] -> q * scale in ``dtype``."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The static fp8 scale for numbers whose largest magnitude was ``amax`` (any shape; float32).
    An all-zero head gets scale 1 (any scale stores zeros exactly)."""
    amax = amax.float()
    return torch.where(amax == 0, 1.0, amax * FP8_HEADROOM / FP8_MAX)


def quantize_kv_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V vectors x [..., kv_heads, head_dim] -> float8_e4m3fn x / scale, saturated at ±448.

    scale: float32 [kv_heads], one per KV head (``fp8_scale``). Read back with
    ``dequantize_kv(q, scale.expand(q.shape[:-1]))``: the same ``q * scale`` as int8."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def kv_vector_bytes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one cached (token, KV head) vector: head_dim values of the model's dtype ("auto"),
    head_dim int8 values and their float32 scale ("int8"), or head_dim fp8 values ("fp8": its
    scales are per layer and KV head, a few bytes for the whole pool)."""
    kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return head_dim * dtype.itemsize
    return head_dim + 4 if kv_cache_dtype == "int8" else head_dim
