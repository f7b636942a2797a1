"""The sparse MLP block of Mixtral, Qwen2-MoE and Qwen3-MoE, and how their checkpoints map onto it.

    x [T, D] -> router (a linear, E logits) -> top-k experts per token (minfer.layers.moe.route_topk)
             -> sum_j weight_j * expert_j(x)                          (minfer.layers.moe.moe_mlp)
             [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]    (Qwen2-MoE only)

The three families differ in two switches only, both read from the checkpoint's config.json:
Mixtral and Qwen3-MoE renormalise the k chosen probabilities to sum to 1 (Qwen's `norm_topk_prob`),
Qwen2-MoE keeps them as they are and adds a shared expert that every token runs.

The experts' weights lie stacked, one tensor per projection (`experts.gate_up_proj` [E, 2F, D],
`experts.down_proj` [E, D, F]), as transformers keeps them in memory; checkpoints store one matrix
per expert (`experts.3.gate_proj.weight`, Mixtral's `experts.3.w1.weight`), which
`stack_expert_weights` stacks at load time.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.layers.moe import moe_mlp, route_topk, tokens_per_expert

# per-expert checkpoint names -> (our stacked tensor, row block within it); Mixtral's w1/w3/w2 and Qwen's
EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
                "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
                "down_proj": ("down_proj", 0), "w2": ("down_proj", 0)}
EXPERT_NAME = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight$")


class Experts(nn.Module):
    """E SwiGLU experts, stacked: gate_up_proj [E, 2F, D] (gate rows, then up rows), down_proj [E, D, F]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for w in (self.gate_up_proj, self.down_proj):  # nn.Linear's default init, expert by expert
            bound = w.shape[2] ** -0.5
            nn.init.uniform_(w, -bound, bound)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert), in place of a decoder layer's MLP.

    dense_mlp(config, intermediate_size) makes the shared expert, a plain SwiGLU MLP: the decoder
    passes its own (`minfer.models.llama.MLP`)."""

    def __init__(self, config: ModelConfig, dense_mlp: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_expert: Optional[nn.Module] = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = dense_mlp(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.impl = "auto"  # see minfer.layers.moe.moe_mlp
        self.last_expert_ids: Optional[torch.Tensor] = None  # [T, k] of the last forward, for the engine's stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, expert_ids = route_topk(self.gate(x), self.top_k, self.normalize)
        self.last_expert_ids = expert_ids
        out = moe_mlp(x, weights, expert_ids, self.experts.gate_up_proj, self.experts.down_proj, self.impl)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


def stack_expert_weights(weights: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Checkpoint names -> ours: per-expert matrices stacked into `experts.gate_up_proj` / `experts.down_proj`,
    and Mixtral's `block_sparse_moe` called `mlp` like everyone else's. Other weights pass through."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for name, tensor in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        match = EXPERT_NAME.match(name)
        if match is None or match.group(3) not in EXPERT_PARTS:
            out[name] = tensor
            continue
        prefix, expert, part = match.groups()
        target, block = EXPERT_PARTS[part]
        pieces.setdefault(f"{prefix}.experts.{target}", {})[(int(expert), block)] = tensor
    for key, found in pieces.items():
        blocks = 2 if key.endswith("gate_up_proj") else 1
        missing = [(e, b) for e in range(num_experts) for b in range(blocks) if (e, b) not in found]
        if missing:
            raise ValueError(f"checkpoint is missing expert weights for {key}: (expert, part) {missing[:4]}")
        out[key] = torch.stack([torch.cat([found[(e, b)] for b in range(blocks)]) for e in range(num_experts)])
    return out


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def last_expert_load(blocks: list[SparseMoeBlock], num_tokens: int, num_experts: int) -> torch.Tensor:
    """Token-expert pairs per expert in each sparse layer's last forward, its first num_tokens rows only
    (the rest are a step's padding): [sparse layers, E] int64, on the model's device."""
    return torch.stack([tokens_per_expert(b.last_expert_ids[:num_tokens], num_experts) for b in blocks])
