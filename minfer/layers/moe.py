"""The mixture-of-experts MLP: route each token to k of E SwiGLU experts, then mix their outputs.

    router_logits [T, E] --route_topk--> weights [T, k], expert_ids [T, k]
    out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t),   e = expert_ids[t, j]

The expert weights lie stacked, as transformers (v5) and vLLM keep them: gate_up [E, 2F, D]
(gate rows first, then up rows) and down [E, D, F]. One function, three implementations:

    "reference"  a loop over the experts, each taking the tokens routed to it (differentiable;
                 minfer.kernels.fused_moe.fused_moe_reference)
    "grouped"    the token-expert pairs sorted by expert once, each used expert's run one SwiGLU
    "triton"     minfer.kernels.fused_moe: the sorted pairs as one grouped matmul per projection

"auto" runs "triton" on CUDA and "grouped" elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.kernels.fused_moe import fused_moe, fused_moe_reference

MOE_IMPLS = ("auto", "reference", "grouped", "triton")


def route_topk(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (in float32), keep the k largest; renormalise them to sum to 1 if asked.

    Mixtral and Qwen3-MoE (norm_topk_prob=True) renormalise, Qwen2-MoE does not: its weights are
    the plain softmax probabilities. Returns (weights [T, k] float32, expert_ids [T, k] int64).
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def moe_mlp(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x [T, D], weights/expert_ids [T, k], gate_up [E, 2F, D], down [E, D, F] -> [T, D] in x's dtype."""
    _check_shapes(x, weights, expert_ids, gate_up, down)
    if impl not in MOE_IMPLS:
        raise ValueError(f"unknown MoE implementation {impl!r}: use one of {MOE_IMPLS}")
    if impl == "auto":
        impl = "triton" if x.is_cuda else "grouped"
    if impl == "reference":
        return moe_mlp_reference(x, weights, expert_ids, gate_up, down)
    if impl == "grouped":
        return moe_mlp_grouped(x, weights, expert_ids, gate_up, down)
    return fused_moe(x, weights, expert_ids, gate_up, down)


def _check_shapes(x, weights, expert_ids, gate_up, down) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if weights.dim() != 2 or weights.shape != expert_ids.shape or weights.shape[0] != x.shape[0]:
        raise ValueError(f"weights and expert_ids must both be [tokens={x.shape[0]}, top_k], got "
                         f"{tuple(weights.shape)} and {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if gate_up.dim() != 3 or gate_up.shape[2] != x.shape[1] or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [experts, 2 * intermediate, hidden={x.shape[1]}], got {tuple(gate_up.shape)}")
    num_experts, two_f, hidden = gate_up.shape
    if tuple(down.shape) != (num_experts, hidden, two_f // 2):
        raise ValueError(f"down must be [experts={num_experts}, hidden={hidden}, intermediate={two_f // 2}], "
                         f"got {tuple(down.shape)}")


def swiglu_expert(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert on its tokens: h [n, D], gate_up [2F, D], down [D, F] -> [n, D]."""
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


# Plain PyTorch, differentiable: for each expert, the (token, slot) pairs routed to it, their outputs
# added in. It lives beside the Triton kernels it is the reference of.
moe_mlp_reference = fused_moe_reference


def moe_mlp_grouped(x, weights, expert_ids, gate_up, down) -> torch.Tensor:
    """The pairs sorted by expert once; each used expert's contiguous run is one SwiGLU, with no
    per-expert search (the reference's `where` per expert). The fastest CPU path measured: gathering
    each pair's expert matrices for one batched matmul was 4-40x slower (docs/benchmarks.md)."""
    num_tokens, top_k = expert_ids.shape
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    runs = x[order // top_k].split(counts)
    y_sorted = torch.cat([swiglu_expert(h, gate_up[e], down[e]) for e, h in enumerate(runs) if counts[e]])
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted  # back to pair order: token t's k outputs side by side
    return _combine(y, weights)


def _combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T * k, D] in pair order -> sum_j weights[t, j] * y[t * k + j], in float32, back in y's dtype."""
    num_tokens, top_k = weights.shape
    mixed = y.view(num_tokens, top_k, -1).float() * weights.unsqueeze(-1).float()
    return mixed.sum(dim=1).to(y.dtype)


def tokens_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many token-expert pairs each expert received: [E] int64 (sums to T * k). (Not torch.bincount: on CUDA
    it reads the ids' range back to the host, which would wait for the step that routed them.)"""
    flat = expert_ids.reshape(-1).long()
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def distinct_experts(expert_ids: torch.Tensor) -> int:
    """How many different experts these tokens touched (whose weights a step must read)."""
    return int(torch.unique(expert_ids).numel())
