"""Activation-aware int4 (the idea of AWQ): give more precision to the weights that meet large inputs.

    quantize_model(model, "awq", group_size=64, calibration_token_ids=calibration_token_ids(tokenizer))
    LLM("smollm2-135m", quantization="awq")      # the same, at load time

Why a weight's error counts in proportion to its input
------------------------------------------------------
Output ``n`` of a linear layer is ``y_n = sum_k W[n, k] * x_k``. Rounding turns ``W[n, k]`` into
``W[n, k] + e[n, k]``, and the output moves by ``sum_k e[n, k] * x_k``: every weight's error is
multiplied by the input it meets. Plain round-to-nearest spends the same precision on every
weight of a group. But the inputs of an LLM's layers are far from even: a few channels of the
normalized residual stream, and a few of the MLP's inner channels, are many times larger than
the rest on almost every token (plot ``activation_means`` for a real layer). The errors in those
columns dominate the output error.

Scaling a column before rounding
--------------------------------
For any positive per-input-channel vector ``s``, ``x @ W.T == (x / s) @ (W * s).T``. Multiply
column ``k`` by ``s_k > 1`` before quantizing: unless that column sets its group's minimum or
maximum, the group's grid step stays the same, so the column's rounding error stays the same
size in the scaled units and shrinks by ``s_k`` in the original units (we divide by ``s_k`` to
get back). The price: a column that is scaled up can widen its group's range and so coarsen
the grid of its neighbours. We therefore take ``s = mean|x|^alpha`` (mean over calibration tokens,
per input channel): ``alpha = 0`` is plain rounding, ``alpha = 1`` scales every column by its
input, and a small grid of alphas is tried per group of layers sharing an input, keeping the
one whose quantized layer reproduces the float outputs best on calibration activations.

Folding 1/s into the operation before
-------------------------------------
The ``x / s`` must cost nothing at run time, so it is folded into whatever produced ``x``, when
that is linear per channel:
- ``qkv_proj`` and ``gate_up_proj`` read an RMSNorm's output ``norm(h) * g``: divide ``g`` by ``s``.
- ``down_proj`` reads ``silu(gate) * up``, linear in ``up``: divide the up rows of ``gate_up_proj``.
- ``o_proj`` reads attention's output, a softmax-weighted sum of value rows, linear in ``v``:
  divide the v rows of ``qkv_proj``. With grouped-query attention one value head feeds several
  query heads, so its channel ``c`` scales the matching column of each of those heads alike.
The float model then computes exactly the same function (up to rounding in its dtype); only the
quantizer sees different matrices. Row scaling (v and up rows) is free for the layer before:
int4 groups run along a row, so a whole group is scaled and its grid scales with it.

Clipping, after scaling
-----------------------
A group's grid runs from its smallest to its largest weight, so one extreme weight coarsens the
step for the other 63. Pulling the range in (to ``r * min .. r * max``, r from 1.0 down to 0.7)
refines the step for all of them and costs error only on the clipped few; per row and group the
r with the smallest error in that group's share of the output is kept. Unlike scaling, this
does change the float model, slightly, in favour of the int4 grid.

What it buys on SmolLM2-135M (bfloat16, `minfer.lab.evaluate`): perplexity +29.5 % -> +10.1 % at
int4 g64; on the channel-scrambled copy (`minfer.lab.bench.quant`) +38.8 % -> +8.8 % at g64 and
+23.5 % -> +6.0 % at g32. Tried and not kept, for no consistent gain: judging qkv_proj and
gate_up_proj by their block's output (attention, MLP) as AWQ does, AWQ's "duo" scales
(mean|x|^alpha / mean|w|^(1 - alpha)), a finer alpha grid, all calibration tokens for the error.

Calibration text: `minfer.texts.calibration_token_ids`, pydoc topics disjoint from the evaluation
set's, so the scales are never fitted to the text they are judged on.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from minfer.formats.weights import quantize_int4_groupwise
from minfer.models.llama import DecoderLayer
from minfer.texts import calibration_token_ids  # noqa: F401  (the chapters 06, 06b and 10 notebooks import it from here)

CALIBRATION_WINDOW = 512
ERROR_TOKENS = 512  # the output error is measured on this many of the calibration tokens (speed)
ALPHAS = tuple(i / 10 for i in range(10))  # 0 is plain rounding: the search never does worse on calibration data
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # 1.0 is no clipping
LINEARS = tuple(name for _, name in DecoderLayer.LINEARS)  # the matrices a decoder layer declares
# Which matrices get clipped. Clipping lowers each matrix's own output error on the calibration
# text, but that error is only a proxy for what the model loses: on SmolLM2-135M, clipping o_proj
# alone raised perplexity (+0.6% -> +2.3%), yet clipping all four matrices or only the MLP's came
# out within 0.3% of each other. We keep AWQ's choice, all four.
CLIP_LINEARS = LINEARS


def fake_quantize_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float matrix int4 round-to-nearest would store for w (same grid as `quantize_int4_groupwise`)."""
    q, scale, minimum = quantize_int4_groupwise(w, group_size)
    out_features, in_features = w.shape
    groups = q.float().reshape(out_features, -1, group_size) * scale.float()[..., None] + minimum.float()[..., None]
    return groups.reshape(out_features, in_features)


def output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Mean squared difference of x @ w.T and x @ w_hat.T (one matmul: x @ (w - w_hat).T)."""
    return (x @ (w - w_hat).T).pow(2).mean().item()


def search_scale(x: torch.Tensor, w: torch.Tensor, act_mean: torch.Tensor, group_size: int,
                 alphas: Sequence[float] = ALPHAS) -> tuple[torch.Tensor, float, list[float]]:
    """The per-input-channel scale s = act_mean^alpha, alpha from alphas, that quantizes w best.

    x [tokens, in] float32 calibration inputs, w [out, in] float32, act_mean [in] mean |x|.
    Returns (s, the best alpha, the output error for each alpha).
    """
    act_mean = act_mean.clamp(min=1e-6)
    best, errors = None, []
    for alpha in alphas:
        s = act_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred on 1 (geometric mean of the extremes): weights keep their range
        errors.append(output_error(x, w, fake_quantize_int4(w * s, group_size) / s))
        if best is None or errors[-1] < best[0]:
            best = (errors[-1], s, alpha)
    return best[1], best[2], errors


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int,
                clip_ratios: Sequence[float] = CLIP_RATIOS) -> torch.Tensor:
    """Per (row, group), the ratio r from clip_ratios for which clipping the group to [r * min, r * max]
    before rounding gives the smallest error in that group's share of the output. Returns [out, groups].

    A group's range is set by its two most extreme weights; pulling it in a little makes the step
    finer for all the others, at the price of a larger error on those two. The error of group g in
    output n is (x_g . d_ng)^2 summed over tokens = d_ng G_g d_ng with G_g = x_g^T x_g, so one small
    Gram matrix per group replaces a pass over the tokens.
    """
    out_features, in_features = w.shape
    xg = x.reshape(-1, in_features // group_size, group_size)
    gram = torch.einsum("tgk,tgl->gkl", xg, xg) / len(x)
    wg = w.reshape(out_features, -1, group_size)
    best_error = torch.full(wg.shape[:2], float("inf"), device=w.device)
    best_ratio = torch.ones(wg.shape[:2], device=w.device)
    for r in clip_ratios:
        ratio = torch.full_like(best_ratio, float(r))
        d = wg - fake_quantize_int4(clip_groups(w, ratio, group_size), group_size).reshape(wg.shape)
        error = (torch.einsum("ngk,gkl->ngl", d, gram) * d).sum(-1)
        better = error < best_error
        best_error, best_ratio = torch.where(better, error, best_error), torch.where(better, ratio, best_ratio)
    return best_ratio


def clip_groups(w: torch.Tensor, ratio: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [out, in] with each group clamped to [ratio * its min, ratio * its max] (ratio [out, groups])."""
    wg = w.reshape(w.shape[0], -1, group_size)
    low, high = wg.amin(-1) * ratio, wg.amax(-1) * ratio
    return torch.minimum(torch.maximum(wg, low[..., None]), high[..., None]).reshape(w.shape)


def _scale_columns(linear: nn.Linear, s: torch.Tensor) -> None:
    linear.weight.copy_(linear.weight.float() * s)


def _divide_rows(linear: nn.Linear, rows: slice, s: torch.Tensor) -> None:
    linear.weight[rows] = linear.weight[rows].float() / s[:, None]
    if linear.bias is not None:
        linear.bias[rows] = linear.bias[rows].float() / s


def _capture_inputs(layer: nn.Module) -> tuple[dict, list]:
    """Forward pre-hooks that keep the input of each of the layer's linears, as float32 [tokens, in]."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for block_name, name in layer.LINEARS:
        block = getattr(layer, block_name)
        if hasattr(block, name):  # a sparse layer's experts are no linears of their own
            def keep(module, args, name=name):
                inputs[name] = args[0].detach().float().flatten(0, -2)
            hooks.append(getattr(block, name).register_forward_pre_hook(keep))
    return inputs, hooks


def calibration_batch(model: nn.Module, token_ids: Sequence[int],
                      window: Optional[int] = None) -> tuple[torch.Tensor, tuple]:
    """The calibration tokens cut into windows of `window` (default CALIBRATION_WINDOW, or the model's
    context if shorter; the rest dropped), embedded: the first decoder layer's input
    [windows, window, hidden], and the RoPE angles every layer shares."""
    window = window or min(CALIBRATION_WINDOW, model.config.max_position_embeddings)
    if not isinstance(window, int) or window < 2 or len(token_ids) < window:
        raise ValueError(f"need an integer window >= 2 and at least that many calibration tokens, got "
                         f"window={window!r} and {len(token_ids)} tokens")
    device = model.embed_tokens.weight.device
    num_windows = len(token_ids) // window
    ids = torch.tensor(list(token_ids[:num_windows * window]), device=device).view(num_windows, window)
    x = model.embed_tokens(ids)
    return x, model.rope(torch.arange(window, device=device).expand(num_windows, window), x.dtype)


def run_layer(model: nn.Module, i: int, x: torch.Tensor, rope: tuple) -> torch.Tensor:
    """Decoder layer i on x (causal attention within each window, no KV cache): the next layer's input."""
    layer = model.layers[i]
    h = x + layer.self_attn(layer.input_layernorm(x), rope, model.attention_fn, None, None, i)
    return h + layer.mlp(layer.post_attention_layernorm(h))


@torch.no_grad()
def apply_awq(model: nn.Module, token_ids: Sequence[int], group_size: int, alphas: Sequence[float] = ALPHAS,
              clip_ratios: Sequence[float] = CLIP_RATIOS, clip_linears: Sequence[str] = CLIP_LINEARS,
              window: Optional[int] = None, error_tokens: int = ERROR_TOKENS) -> list[dict]:
    """Fold activation-aware scales into the model in place, then clip each group's range.

    Runs the calibration tokens (in windows of `window`; default CALIBRATION_WINDOW, or the
    model's context if shorter) through the model one decoder layer at a time; at each layer
    records the four linears' inputs, searches a scale per matrix (alphas) and folds it, which
    leaves the float model's outputs the same. Then clips each group's range in the matrices
    named in clip_linears (clip_ratios; (1.0,) or clip_linears=() = no clipping), which does
    change the float weights, in favour of the int4 grid.
    Quantize afterwards (`quantize_model(model, "int4", ...)`). Returns, per layer, the chosen
    alpha per matrix and the mean clip ratio.
    """
    config = model.config
    for name, values in (("alphas", alphas), ("clip_ratios", clip_ratios)):
        low = 0 if name == "alphas" else 1e-3
        if len(values) == 0 or any(not low <= v <= 1 for v in values):
            raise ValueError(f"{name} must be a non-empty sequence of numbers in [{low}, 1], got {values!r}")
    if not set(clip_linears) <= set(LINEARS):
        raise ValueError(f"clip_linears must name matrices from {LINEARS}, got {clip_linears!r}")
    x, rope = calibration_batch(model, token_ids, window)
    every = max(1, x.shape[0] * x.shape[1] // error_tokens)
    report = []
    for i, layer in enumerate(model.layers):
        inputs, hooks = _capture_inputs(layer)
        x = run_layer(model, i, x, rope)  # the next layer's input, from the float model
        for hook in hooks:
            hook.remove()
        chosen = {"layer": i}
        for name, (linear, s) in _fold_layer_scales(layer, config, inputs, every, group_size, alphas, chosen).items():
            if name not in clip_linears:
                continue
            ratio = search_clip(inputs[name] / s, linear.weight.float(), group_size, clip_ratios)
            linear.weight.copy_(clip_groups(linear.weight.float(), ratio, group_size))
            chosen[f"{name} clip"] = ratio.mean().item()
        report.append(chosen)
    return report


def _fold_layer_scales(layer: nn.Module, config, inputs: dict, every: int, group_size: int,
                       alphas: Sequence[float], chosen: dict) -> dict[str, tuple[nn.Linear, torch.Tensor]]:
    """Search and fold the scale of each of the layer's four linears; returns name -> (linear, its scale)."""
    attn, mlp = layer.self_attn, layer.mlp
    group = config.num_heads // config.num_kv_heads
    q_size, kv_size, inner = attn.q_size, attn.kv_size, config.intermediate_size
    scales = {}

    def search(name: str, linear: nn.Linear, act_mean: torch.Tensor) -> torch.Tensor:
        s, chosen[name], _ = search_scale(inputs[name][::every], linear.weight.float(), act_mean, group_size, alphas)
        _scale_columns(linear, s)
        scales[name] = (linear, s)
        return s

    # qkv_proj and gate_up_proj: 1/s goes into the RMSNorm before them
    for name, linear, norm in (("qkv_proj", attn.qkv_proj, layer.input_layernorm),
                               ("gate_up_proj", mlp.gate_up_proj, layer.post_attention_layernorm)):
        s = search(name, linear, inputs[name].abs().mean(0))
        norm.weight.copy_(norm.weight.float() / s)
    # o_proj: one scale per value-head channel, shared by the query heads that read that value head
    o_mean = inputs["o_proj"].abs().mean(0).view(config.num_kv_heads, group, config.head_dim).mean(1)
    s = search("o_proj", attn.o_proj, o_mean.repeat_interleave(group, dim=0).flatten())
    _divide_rows(attn.qkv_proj, slice(q_size + kv_size, q_size + 2 * kv_size),
                 s.view(config.num_kv_heads, group, config.head_dim)[:, 0].flatten())
    # down_proj: into the up rows of gate_up_proj (silu(gate) * up is linear in up)
    s = search("down_proj", mlp.down_proj, inputs["down_proj"].abs().mean(0))
    _divide_rows(mlp.gate_up_proj, slice(inner, 2 * inner), s)
    return scales


def activation_means(model: nn.Module, token_ids: Sequence[int], layer: int = 0) -> dict[str, torch.Tensor]:
    """Mean |input| per channel of each of one decoder layer's four linears (for plots)."""
    if not 0 <= layer < len(model.layers):
        raise ValueError(f"layer must be in [0, {len(model.layers)}), got {layer!r}")
    inputs, hooks = _capture_inputs(model.layers[layer])
    ids = torch.tensor([list(token_ids)], device=model.embed_tokens.weight.device)
    try:
        model(ids, torch.arange(ids.shape[1], device=ids.device)[None])
    finally:
        for hook in hooks:
            hook.remove()
    return {name: x.abs().mean(0) for name, x in inputs.items()}
