"""GPTQ (Frantar et al., 2022): round one column at a time, and let the columns not yet rounded make up for it.

    quantize_model(model, "gptq", group_size=64, calibration_token_ids=calibration_token_ids(tokenizer))
    LLM("smollm2-135m", quantization="gptq")     # the same, at load time

Same int4 format as "int4" and "awq" (``minfer.formats.weights``: groups of 32 or 64 inputs, a
float16 scale and minimum each, two codes per byte), so every int4 matmul path serves it. Only
the choice of codes (and of each group's grid) differs from round-to-nearest.

The error that matters
----------------------
A linear layer turns inputs ``X [tokens, in]`` into ``X W.T``. Rounding ``W`` to ``Ŵ`` costs, per
output row ``w``, ``||X (w - ŵ)||² = (w - ŵ)ᵀ H (w - ŵ) / 2`` with the input Hessian
``H = 2 XᵀX``, collected on a calibration text. Round-to-nearest minimises each weight's own
error and ignores ``H``; but inputs are correlated (off-diagonal ``H``), so an error in one
column can be partly cancelled by changing the others.

One column at a time (Optimal Brain Surgeon's update)
-----------------------------------------------------
Quantize column ``i``: its error is ``e = w_i - ŵ_i`` (one number per row). With ``F`` the
columns not yet quantized, the change of ``w_F`` that minimises the output error given that
column ``i`` is now fixed is

    w_F -= e / [H_F⁻¹]_ii * [H_F⁻¹]_{i,F}

then column ``i`` leaves ``F``: ``H_F⁻¹`` loses row and column ``i`` (one step of Gaussian
elimination). GPTQ's three observations make this fast enough for an LLM:
- *The same order for every row.* All rows quantize column 0, then 1, ...: one ``H⁻¹`` sequence
  for the whole matrix instead of one per row.
- *Cholesky.* The rows ``[H_F⁻¹]_{i,F} / sqrt([H_F⁻¹]_ii)`` for F = {i, i+1, ...} are exactly the
  rows of the upper Cholesky factor ``U`` of ``H⁻¹`` (``UᵀU = H⁻¹``), so the update reads
  ``w_F -= (e / U_ii) * U_{i,F}``: compute ``U`` once, never eliminate anything.
- *Lazy batches.* Columns are done in blocks of 128: the update runs in full inside the block,
  while the columns after the block get the block's errors all at once, one matrix product.
  Same result, far fewer passes over the big matrix.
``H`` is dampened by a fraction of its mean diagonal before inverting: a nearly singular ``H``
(inputs that move together) would otherwise give huge, noisy updates. GPTQ's paper uses 1 %
(``DAMPING``, the default for one matrix); a whole model takes 20 % (``MODEL_DAMPING``), which
measured better here (below). An input that is zero on every
calibration token (``H_ii = 0``) cannot affect the output: its weights are set to zero and
``H_ii`` to 1, so it neither receives nor spreads error.

Groups, and their grids
-----------------------
A group's scale and minimum are fixed when its first column is reached, from the weights as the
updates so far have left them (GPTQ's rule): the grid fits what will actually be rounded. The
updates can still carry a later column of the group past that range; it is clamped to the grid.

Activation order (``desc_act``)
-------------------------------
Quantizing the columns with the largest ``H_ii`` first (the inputs that are large most often)
lets them pass their error to many columns, and leaves the least important ones for last, when
few columns remain to absorb errors. With groups, the columns of one group are then no longer
quantized together, and GPTQ's checkpoints record each column's group in a ``g_idx``
permutation. minfer's int4 format has contiguous groups and no ``g_idx``, so we use "static
groups": every group's grid is computed from the weights before any update, and the columns are
then quantized in activation order, each on its own group's grid. Lossless in minfer's format,
at the price of grids that never see the updates. ``static_groups=False`` keeps GPTQ's rule
instead: a group's grid is fitted when its first column comes up in activation order, to all its
columns as the updates so far have left them (still one grid per contiguous group, the same
format). On SmolLM2-135M at int4 g64 (with 1 % damping) that is better on the channel-scrambled
copy and slightly worse on the real model (``docs/benchmarks.md``), so static groups stay the default.

Any grid: fp8 (``gptq_quantize_fp8``, ``quantization="gptq_fp8"``)
----------------------------------------------------------------
Nothing in the column loop (``gptq_columns``) depends on what a column is rounded to: it needs the
rounded values, to compute the error it passes on. On e4m3's grid, each output channel with the scale
round-to-nearest gives it (its largest magnitude before any update onto 448), the result is the same
fp8 format, layers and checkpoints as "fp8". On SmolLM2-135M (bfloat16, int8 output head): +0.31 %
perplexity against round-to-nearest's +1.55 %, +0.39 % against +1.63 % on the scrambled copy.

Layers in sequence
------------------
Each matrix's ``H`` comes from the inputs the *quantized* model produces: the calibration text
runs through the decoder layers one at a time, and within a layer qkv_proj, o_proj, gate_up_proj
and down_proj are quantized in the order they run, each one's inputs computed with the matrices
before it already quantized ("true-sequential"; ``apply_gptq``'s ``sequential``). So each matrix
also makes up for the errors of those before it. The inputs come from the layer capture AWQ uses
(``minfer.quant.awq``).

What "gptq" runs (``quantize_model``'s ``gptq_after_awq`` and ``gptq_desc_act``, both on by default)
---------------------------------------------------------------------------------------------------
GPTQ on the matrices after AWQ has folded its activation-aware scales into them
(``minfer.quant.awq``, its clipping left out), in activation order, with 20 % damping. On
SmolLM2-135M at int4 g64 (perplexity increase, bfloat16, with 1 % damping): plain GPTQ +16.8 %,
activation order +9.0 %, AWQ's scales first +8.4 %, both +6.1 %; with AWQ's clipping as well
+8.1 % (clipping fits groups to round-to-nearest, which GPTQ no longer does). AWQ alone: +10.1 %.
Then, with 1 %, 10 %, 20 % and 30 % damping: +5.8 %, +5.6 %, +4.8 % and +5.3 % on the real model,
+8.2 %, +6.6 % and +7.3 % (20 %) on the channel-scrambled copy (another CPU than the figures
before). The damping was chosen on the evaluation text itself, so the real model's +4.8 % flatters
it a little (its neighbours are within half a point, about the run-to-run spread of such changes);
the scrambled copy, not used for the choice, agrees in direction. Tried and not
kept, each worse on the real model: choosing each group's grid before the column loop by a
Hessian-weighted error over a few shrunk ranges (the clamping it adds costs more than the finer
step gains), choosing AWQ's alpha by GPTQ's error instead of round-to-nearest's, and quantizing
without true-sequential inputs (``sequential=False``). All figures: ``docs/benchmarks.md``.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from minfer.formats.fp8 import dequantize_fp8_rows, quantize_fp8_rows, quantize_fp8_with
from minfer.formats.weights import (check_group_size, dequantize_int4, pack_int4, quantize_int4_groupwise,
                                   round_to_int4_grid)
from minfer.quant.awq import _capture_inputs, calibration_batch, run_layer

BLOCK_SIZE = 128  # columns per lazy batch
# Fraction of the mean diagonal of H added to its diagonal: GPTQ's paper uses 0.01, the default for one matrix.
DAMPING = 0.01
# A whole model (apply_gptq, quantization="gptq") takes more: on SmolLM2-135M at int4 g64, 0.2 measured better
# on the real model and on the channel-scrambled copy (docs/benchmarks.md).
MODEL_DAMPING = 0.2


def input_hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 XᵀX / tokens for inputs x [tokens, in] (float32 [in, in]): the output error's curvature."""
    x = x.float()
    return 2 * (x.T @ x) / x.shape[0]


def inverse_hessian_cholesky(hessian: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """The upper Cholesky factor U of (H + damping * mean(diag H) * I)⁻¹, so that UᵀU = H⁻¹."""
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    dampened = hessian + damping * hessian.diagonal().mean() * eye
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(dampened))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_columns(w: torch.Tensor, u: torch.Tensor, round_column: Callable, block_size: int = BLOCK_SIZE) -> None:
    """The column loop, whatever the grid: the columns of w [out, in] (in quantization order, updated in place)
    are rounded in turn, each one's error spread over the columns after it (u: `inverse_hessian_cholesky` of
    the Hessian in the same order). round_column(column, values, current) rounds one column, keeps its codes and
    returns the values they stand for; current(columns) gives any columns as the updates so far have left them
    (a grid fitted on the way needs it)."""
    in_features = w.shape[1]
    for start in range(0, in_features, block_size):
        end = min(start + block_size, in_features)
        block = w[:, start:end]  # a view: the in-block updates land in w
        errors = torch.zeros_like(block)

        def current(columns: torch.Tensor) -> torch.Tensor:
            values = w[:, columns]
            later = columns >= end  # past this block, they lack the updates of its columns so far
            values[:, later] -= errors @ u[start:end, columns[later]]
            return values

        for i in range(end - start):
            column = start + i
            rounded = round_column(column, block[:, i], current)
            errors[:, i] = (block[:, i] - rounded) / u[column, column]
            block[:, i:] -= errors[:, i:i + 1] * u[column, start + i:end][None]
        w[:, end:] -= errors @ u[start:end, end:]  # the block's errors, all at once, onto the later columns


def _prepare(w: torch.Tensor, hessian: torch.Tensor, damping: float, desc_act: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w and H in the compute dtype, dead inputs zeroed, both in quantization order: (w, u, order, position)."""
    compute = torch.float64 if w.dtype == torch.float64 else torch.float32
    w, hessian = w.to(compute).clone(), hessian.to(compute).clone()
    dead = hessian.diagonal() == 0
    hessian[dead, dead] = 1
    w[:, dead] = 0
    in_features = w.shape[1]
    order = (torch.argsort(hessian.diagonal(), descending=True) if desc_act
             else torch.arange(in_features, device=w.device))
    position = torch.empty_like(order)  # position[k]: when input k is quantized
    position[order] = torch.arange(in_features, device=w.device)
    return w[:, order], inverse_hessian_cholesky(hessian[order][:, order], damping), order, position


def _check_hessian(w: torch.Tensor, hessian: torch.Tensor) -> None:
    if hessian.shape != (w.shape[1], w.shape[1]):
        raise ValueError(f"the Hessian must be [{w.shape[1]}, {w.shape[1]}] for w {tuple(w.shape)}, "
                         f"got {tuple(hessian.shape)}")


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, block_size: int = BLOCK_SIZE,
                  damping: float = DAMPING, desc_act: bool = False, static_groups: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q uint8 [out, in] in 0..15, scale float16 [out, in // group_size], min float16 [same]),
    minfer's int4 format (`quantize_int4_groupwise`'s), with the codes GPTQ chooses for the Hessian H [in, in].

    Computes in float32 (float64 if w is float64). block_size: columns per lazy batch, a multiple
    of group_size. desc_act: columns in decreasing H_ii order, each group on a grid fitted to the
    weights before any update (static_groups) or when its first column comes up, to the weights as
    updated so far (module docstring).
    """
    out_features, in_features = w.shape
    check_group_size(in_features, group_size)
    _check_hessian(w, hessian)
    if block_size <= 0 or block_size % group_size:
        raise ValueError(f"block_size must be a positive multiple of group_size {group_size}, got {block_size!r}")
    w, u, order, position = _prepare(w, hessian, damping, desc_act)
    num_groups = in_features // group_size
    if desc_act and static_groups:  # every grid from the weights before any update (in natural column order)
        natural = torch.empty_like(w)
        natural[:, order] = w
        _, scale, minimum = quantize_int4_groupwise(natural, group_size)
    else:
        scale = torch.zeros(out_features, num_groups, dtype=torch.float16, device=w.device)
        minimum = torch.zeros_like(scale)
    q = torch.zeros(out_features, in_features, dtype=torch.uint8, device=w.device)
    columns = order.tolist()  # read once: indexing a device tensor per column waits for the GPU each time
    fitted = [desc_act and static_groups] * num_groups

    def round_column(column: int, values: torch.Tensor, current: Callable) -> torch.Tensor:
        group = columns[column] // group_size
        if not fitted[group]:  # the group's first column: its grid, from the weights as updated so far
            _, group_scale, group_min = quantize_int4_groupwise(
                current(position[group * group_size:(group + 1) * group_size]), group_size)
            scale[:, group], minimum[:, group] = group_scale[:, 0], group_min[:, 0]
            fitted[group] = True
        codes = round_to_int4_grid(values, scale[:, group], minimum[:, group])
        q[:, column] = codes
        return codes.to(values.dtype) * scale[:, group].to(values.dtype) + minimum[:, group].to(values.dtype)

    gptq_columns(w, u, round_column, block_size)
    q_natural = torch.empty_like(q)
    q_natural[:, order] = q
    return q_natural, scale, minimum


def gptq_quantize_fp8(w: torch.Tensor, hessian: torch.Tensor, block_size: int = BLOCK_SIZE,
                      damping: float = DAMPING, desc_act: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q float8_e4m3fn [out, in], scale float32 [out, 1]), the fp8 rows of
    `minfer.formats.fp8` (each row's scale from its largest magnitude before any update), with the values GPTQ
    chooses: the same column loop on e4m3's grid. An update that carries a weight past ±448 x scale is clamped."""
    _check_hessian(w, hessian)
    w, u, order, _ = _prepare(w, hessian, damping, desc_act)
    q, scale = quantize_fp8_rows(w)  # the scales: a row's largest magnitude, whatever the column order

    def round_column(column: int, values: torch.Tensor, current: Callable) -> torch.Tensor:
        codes = quantize_fp8_with(values[:, None], scale)
        q[:, column] = codes[:, 0]
        return dequantize_fp8_rows(codes, scale, values.dtype)[:, 0]

    gptq_columns(w, u, round_column, block_size)
    q_natural = torch.empty_like(q)
    q_natural[:, order] = q
    return q_natural, scale


@torch.no_grad()
def apply_gptq(model: nn.Module, token_ids: Sequence[int], group_size: Optional[int], desc_act: bool = False,
               block_size: int = BLOCK_SIZE, damping: float = MODEL_DAMPING, window: Optional[int] = None,
               static_groups: bool = True, sequential: bool = True, fp8: bool = False
               ) -> dict[tuple[int, str], tuple[torch.Tensor, ...]]:
    """Choose GPTQ's codes for the four matrices of every decoder layer, in sequence (module docstring).

    Each float weight is overwritten with what its codes stand for, so that the layers after it see
    the quantized model's activations. static_groups: `gptq_quantize`'s. sequential=False takes a
    layer's four inputs in one pass, before any of its matrices is quantized (only the earlier
    layers are then quantized ones). fp8: round to e4m3 rows (`gptq_quantize_fp8`, no groups) instead of int4 groups.
    Returns {(layer index, matrix name): codes}: (packed codes, scale, minimum), minfer's int4 format, or
    (e4m3 codes, scale [out, 1]); `quantize_model(model, "gptq" or "gptq_fp8", ...)` turns them into layers.
    """
    x, rope = calibration_batch(model, token_ids, window)
    codes = {}
    for i, layer in enumerate(model.layers):
        for k, (block_name, name) in enumerate(layer.LINEARS):
            if sequential or k == 0:
                inputs, hooks = _capture_inputs(layer)
                run_layer(model, i, x, rope)  # the matrices before this one are already quantized (if sequential)
                for hook in hooks:
                    hook.remove()
            linear = getattr(getattr(layer, block_name), name)
            hessian = input_hessian(inputs[name])
            if fp8:
                q, scale = gptq_quantize_fp8(linear.weight, hessian, block_size, damping, desc_act)
                codes[i, name] = (q, scale)
                linear.weight.copy_(dequantize_fp8_rows(q, scale))
            else:
                q, scale, minimum = gptq_quantize(linear.weight, hessian, group_size, block_size, damping, desc_act,
                                                  static_groups)
                codes[i, name] = (pack_int4(q), scale, minimum)
                linear.weight.copy_(dequantize_int4(codes[i, name][0], scale, minimum))
        x = run_layer(model, i, x, rope)
    return codes
