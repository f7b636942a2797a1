"""Chapter 06b: post-training quantization (GPTQ) and quantization-aware training, and NF4.

Fill in each function (replace `raise NotImplementedError`); the notebook's cells compare each one with
minfer's as soon as it is written, and `check("ch06b")` runs the chapter's tests. Work in float32 (float64
where a test passes it); every function takes and returns torch tensors.
"""
from __future__ import annotations

import torch


# -------------------- GPTQ: round a column, push its error onto the columns not yet rounded


def inverse_hessian_cholesky(hessian: torch.Tensor, damping: float = 0.01) -> torch.Tensor:
    """The upper Cholesky factor U of (H + damping * mean(diag H) * I)^-1, so that U.T @ U = H^-1."""
    raise NotImplementedError("write me")


def gptq_column_update(w: torch.Tensor, u: torch.Tensor, i: int, rounded: torch.Tensor) -> torch.Tensor:
    """One GPTQ step: round column i, and move the columns not yet rounded to make up for its error.

    w: [out, in] float weights; its columns before i are already rounded and stay as they are.
    u: [in, in], the upper Cholesky factor U of H^-1 (U.T @ U = H^-1, as `inverse_hessian_cholesky`
    returns it), H the layer's (damped) input Hessian: a change d of one row of weights adds d H d.T / 2 to
    that row's output error. i: the column to round. rounded: [out], the value column i takes in
    each row.
    Returns a new [out, in] matrix: the columns before i as in w, column i equal to `rounded`, and
    the columns after i changed, row by row, so that the output error the step adds, d H d.T / 2
    (d: the row's change, zero before column i, rounded - w[:, i] at column i), is as small as it
    can be. The change can be written with row i of U alone. w itself is left unchanged.
    """
    raise NotImplementedError("write me")


def round_to_grid(column: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The nearest value of each row's int4 grid (q * scale + minimum, q in 0..15) for one column [out].

    A row whose scale is 0 (a constant group) has one grid value: its minimum."""
    raise NotImplementedError("write me")


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """int4 with GPTQ's codes, returned dequantized [out, in]: columns in order; each group's grid
    (scale = (max - min) / 15, minimum = min per row) from the weights as the updates left them when
    the group's first column is reached; then every column rounded and its error pushed on, with U
    from inverse_hessian_cholesky at its default damping."""
    raise NotImplementedError("write me")


# -------------------- NF4: 16 levels at normal quantiles, an absmax per block


def nf4_levels() -> torch.Tensor:
    """QLoRA's 16 NF4 levels, ascending, in [-1, 1] with an exact 0: 8 positive normal quantiles of
    probabilities linspace(0.9677083, 0.5, 9)[:-1], 7 negative ones of linspace(0.9677083, 0.5, 8)[:-1],
    and 0, all divided by the largest."""
    raise NotImplementedError("write me")


def quantize_nf4(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (codes uint8 [out, in] in 0..15, absmax float32 [out, in // block_size]): each weight's
    code is the index of the level nearest to w / absmax of its block. An all-zero block: absmax 0, code 7 (0.0).
    Raise ValueError if in is not a multiple of block_size."""
    raise NotImplementedError("write me")


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
    """The float32 matrix [out, in] that NF4 codes stand for: levels[code] * absmax of the block."""
    raise NotImplementedError("write me")


# -------------------- QAT: fake quantization with a straight-through gradient


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """What int4 round-to-nearest in groups (chapter 06's grid) stores for w, as floats [out, in].

    Per group of group_size inputs of a row: scale = (max - min) / 15 and minimum = min, both float32 and
    unrounded; q = round((w - minimum) / scale) clamped to 0..15 (scale 0: q = 0); returns q * scale + minimum."""
    raise NotImplementedError("write me")


def straight_through(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Forward: fake_quantize_int4(w). Backward: the identity (the gradient reaches w unchanged)."""
    raise NotImplementedError("write me")


class FakeQuantLinear(torch.nn.Module):
    """A bias-free linear layer that trains a float weight [out, in] but always multiplies by its int4 rounding."""

    def __init__(self, weight: torch.Tensor, group_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone().float())
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("write me")
