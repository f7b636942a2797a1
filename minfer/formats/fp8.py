"""fp8 e4m3 rows: a weight matrix per output channel, or activations per token, each row with its own scale.

e4m3 (``torch.float8_e4m3fn``) is a float: a sign, 4 exponent bits and 3 mantissa bits, finite numbers
up to ±448. Unlike int8's evenly spaced grid, its steps grow with the number: every value from 2^-6 to
448 is stored within 1/16 of itself. That suits weights, whose few large values would stretch an
even grid for all the small ones.

One float32 scale per row maps the row's largest magnitude onto 448:

    scale = max|x| / 448        q = fp8(x / scale)        x ~ q * scale

For a weight matrix [out, in] a row is an output channel, so the scale factors out of the matmul
(``x @ (q * s).T == (x @ q.T) * s``); for activations [tokens, in] a row is a token, scaled on the
fly (dynamic scaling: no calibration). Both scales then apply to the fp8 product at once:
``(xq @ wq.T) * x_scale[:, None] * w_scale[None, :]``, which is what ``torch._scaled_mm`` computes
on fp8 tensor cores (sm_89 and later).
"""
from __future__ import annotations

import torch

from minfer.formats.kv import FP8_DTYPE, FP8_MAX


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q float8_e4m3fn [..., n], scale float32 [..., 1]) with x ~= q * scale.

    Each row's largest magnitude becomes 448; an all-zero row gets scale 1 and stores zeros."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax == 0, 1.0, amax / FP8_MAX)
    return quantize_fp8_with(x, scale), scale


def quantize_fp8_with(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, what lies beyond ±448 clamped: the codes of x on a given scale."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of ``quantize_fp8_rows``: q * scale in ``dtype``."""
    return (q.float() * scale).to(dtype)
