"""A tiny language model trained twice, dense and as a mixture of experts (chapter 10).

    data = byte_splits()
    dense = train(TinyConfig(num_experts=0), data, steps=300)
    switch = train(TinyConfig(num_experts=8, top_k=1, aux_loss_coef=0.01), data, steps=300)

The two have the same active compute per token: the dense MLP has d_ff = F, and each of the E
experts has d_ff = F too, top-1 (Switch Transformers) picking one of them per token. The MoE model
holds E times the MLP parameters but runs the same number of multiply-adds, so its loss is compared
with the dense model's against training FLOPs (6 x active parameters x tokens, the usual estimate).

Routing follows Switch Transformers (Fedus, Zoph, Shazeer, 2021): the router's softmax probability
of the chosen expert scales its output (with top-1, renormalising would make every weight 1 and
give the router no gradient), an auxiliary loss E * sum_e f_e * P_e pulls the load towards even,
and an expert takes at most capacity = capacity_factor * tokens * k / E tokens per batch: the
ones beyond it are dropped (that expert adds nothing for them; the residual stream carries them on).

Text: the bytes of Python's own documentation (`pydoc_data.topics`) outside the evaluation
topics (`minfer.texts`) and the one that repeats them; a few topics are held out to measure the loss on.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minfer.layers.moe import moe_mlp, route_topk
from minfer.texts import EVAL_TOPICS

VALIDATION_TOPICS = ("calls", "comparisons", "numeric-types")
# "compound" repeats the evaluation topics try, with, function and class: left out too
LEFT_OUT_TOPICS = EVAL_TOPICS + ("compound",)


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 256  # bytes
    dim: int = 128
    num_layers: int = 2
    num_heads: int = 4
    context: int = 64
    d_ff: int = 256  # per expert, and the dense model's
    num_experts: int = 0  # 0: dense
    top_k: int = 1
    aux_loss_coef: float = 0.0  # Switch's load-balancing loss weight (0.01 in the paper)
    capacity_factor: Optional[float] = None  # None: no token is dropped

    def __post_init__(self) -> None:
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.top_k <= self.num_experts):
            raise ValueError(f"need num_experts >= 0 and 1 <= top_k <= num_experts, got {self.num_experts}, {self.top_k}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor!r}")


def byte_splits(seed: int = 0) -> dict[str, torch.Tensor]:
    """Training and validation bytes: pydoc topics outside the evaluation set, a few held out."""
    from pydoc_data.topics import topics

    names = sorted(t for t in topics if t not in LEFT_OUT_TOPICS)
    join = lambda chosen: torch.tensor(list("\n\n".join(topics[t].strip() for t in chosen).encode()), dtype=torch.long)
    return {"train": join([t for t in names if t not in VALIDATION_TOPICS]), "val": join(VALIDATION_TOPICS)}


def load_balancing_loss(router_probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformers' auxiliary loss E * sum_e f_e * P_e: f_e the share of token-expert
    assignments that went to expert e (no gradient: it counts), P_e the mean router probability
    of e (the gradient flows through it). 1.0 when both are even; up to E when one expert takes all."""
    f = torch.bincount(expert_ids.flatten(), minlength=num_experts).float() / expert_ids.numel()
    return num_experts * (f * router_probs.mean(0)).sum()


def capacity_mask(expert_ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: which assignments fit within each expert's capacity. First choices are served
    before second choices, and within one rank earlier tokens first (Switch's order)."""
    by_rank = expert_ids.T.reshape(-1)  # rank-major: every token's first choice, then every second choice
    one_hot = F.one_hot(by_rank, num_experts)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # place of each assignment in its expert's queue
    return (position < capacity).view(expert_ids.shape[1], -1).T


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


class MoEFeedForward(nn.Module):
    """E SwiGLU experts behind a linear router; forward returns the output and the routing it chose."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        e, f, d = config.num_experts, config.d_ff, config.dim
        self.router = nn.Linear(d, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * f, d) / math.sqrt(d))
        self.down = nn.Parameter(torch.randn(e, d, f) / math.sqrt(f))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        c = self.config
        logits = self.router(x)
        weights, ids = route_topk(logits, c.top_k, normalize=c.top_k > 1)
        kept = torch.ones_like(ids, dtype=torch.bool)
        if c.capacity_factor is not None:
            kept = capacity_mask(ids, c.num_experts, expert_capacity(len(x), c.top_k, c.num_experts, c.capacity_factor))
            weights = weights * kept
        out = moe_mlp(x, weights, ids, self.gate_up, self.down, impl="reference")
        return out, {"probs": logits.softmax(-1), "expert_ids": ids, "kept": kept}


class DenseFeedForward(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(config.dim, 2 * config.d_ff, bias=False)
        self.down = nn.Linear(config.d_ff, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), None


class Block(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.out = nn.Linear(config.dim, config.dim, bias=False)
        self.ffn = MoEFeedForward(config) if config.num_experts else DenseFeedForward(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[dict]]:
        b, t, d = x.shape
        q, k, v = self.qkv(F.rms_norm(x, (d,))).view(b, t, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        h, routing = self.ffn(F.rms_norm(x, (d,)).reshape(b * t, d))
        return x + h.view(b, t, d), routing


class TinyLM(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Parameter(torch.randn(config.context, config.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Logits [batch, seq, vocab] and each MoE layer's routing (empty for the dense model)."""
        x = self.embed(ids) + self.pos[:ids.shape[1]]
        routings = []
        for block in self.blocks:
            x, routing = block(x)
            if routing is not None:
                routings.append(routing)
        return self.head(F.rms_norm(x, (x.shape[-1],))), routings


def active_params(config: TinyConfig) -> int:
    """Parameters one token runs through (the embedding lookup excluded; the head included)."""
    d, f = config.dim, config.d_ff
    mlp = 3 * d * f * config.top_k + d * config.num_experts if config.num_experts else 3 * d * f
    return config.num_layers * (4 * d * d + mlp) + d * config.vocab_size


def total_params(model: TinyLM) -> int:
    return sum(p.numel() for p in model.parameters())


def batches(data: torch.Tensor, batch_size: int, context: int, generator: torch.Generator):
    """Endless random windows of context + 1 bytes: inputs and next-byte targets."""
    while True:
        starts = torch.randint(len(data) - context - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def evaluate(model: TinyLM, data: torch.Tensor, batch_size: int = 64, num_batches: int = 4) -> dict:
    """Validation loss on fixed windows, and the routing seen there (for load histograms)."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses, routings = [], []
    for _, (x, y) in zip(range(num_batches), batches(data, batch_size, model.config.context, gen)):
        logits, r = model(x)
        losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
        routings.append(r)
    model.train()
    return {"loss": sum(losses) / len(losses), "routings": routings}


def train(config: TinyConfig, data: dict[str, torch.Tensor], steps: int = 300, batch_size: int = 32,
          lr: float = 3e-3, eval_every: int = 50, seed: int = 0,
          progress: Optional[Callable[[int], None]] = None) -> dict:
    """Train a TinyLM; returns the model and its curves: validation loss against steps and FLOPs."""
    torch.manual_seed(seed)
    model = TinyLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    flops_per_step = 6 * active_params(config) * batch_size * config.context
    curve = []
    start = time.perf_counter()
    stream = batches(data["train"], batch_size, config.context, torch.Generator().manual_seed(seed))
    for step in range(1, steps + 1):
        x, y = next(stream)
        for group in opt.param_groups:  # short warm-up, then cosine decay
            group["lr"] = lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        logits, routings = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if config.aux_loss_coef:
            aux = sum(load_balancing_loss(r["probs"], r["expert_ids"], config.num_experts) for r in routings)
            loss = loss + config.aux_loss_coef * aux / len(routings)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, "flops": step * flops_per_step, "val_loss": evaluate(model, data["val"])["loss"],
                          "seconds": time.perf_counter() - start})
        if progress:
            progress(step)
    return {"model": model, "config": asdict(config), "curve": curve, "active_params": active_params(config),
            "total_params": total_params(model)}


def expert_load(routings: list, num_experts: int) -> list[list[float]]:
    """Per MoE layer, the share of token-expert assignments each expert received
    (routings: `evaluate`'s, a list over batches of lists over layers)."""
    loads = []
    for layer in range(len(routings[0])):
        ids = torch.cat([per_batch[layer]["expert_ids"].flatten() for per_batch in routings])
        loads.append((torch.bincount(ids, minlength=num_experts).float() / len(ids)).tolist())
    return loads


def dropped_share(routings: list, num_experts: int, top_k: int, capacity_factor: float) -> float:
    """Share of assignments a capacity of capacity_factor x even share would drop, over these routings."""
    dropped = total = 0
    for per_batch in routings:
        for r in per_batch:
            ids = r["expert_ids"]
            kept = capacity_mask(ids, num_experts, expert_capacity(len(ids), top_k, num_experts, capacity_factor))
            dropped += int((~kept).sum())
            total += kept.numel()
    return dropped / total
