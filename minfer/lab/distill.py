"""A draft model distilled from its target, for speculative decoding (chapter 08).

A draft earns its keep by guessing what the target will say (acceptance rate alpha) while
costing little per step (cost ratio c = draft step time / target step time). Two choices here:

Cheap: two decoder layers copied from the target (their MLP pruned to the neurons with the
largest weights), the target's final norm, and an output head over only the K most frequent
tokens (FR-Spec / EAGLE-3). The full 49152 x 576 head is a fifth of SmolLM2-135M's weights:
a draft that kept it could never get much below c = 0.2. The embedding is the target's own,
shared at load time, so the file holds only the layers, the norm and the K head rows. The
draft can never propose a token outside its head; losslessness does not suffer, because the
target verifies every proposal; only acceptance pays, by the target's mass outside the head.

Faithful: it is trained to match the target's next-token distributions, not the text's.
The loss is KL(p_target || p_draft) where p_target is the target's softmax restricted to the
head tokens and renormalised (the mass outside the head is masked out: the draft could not
place it anywhere useful), and of that only the teacher's top-k entries are kept so the
target's logits can be computed once and stored. Those distributions come from the target
reading pydoc text and its own chat answers, so the draft learns how the target talks.

Reproduce the shipped weights (one thread, fixed seeds, bf16 autocast, on a CPU with bf16 support:
an AVX2-only one trains in float32 and ends elsewhere; about 10 minutes of one CPU core, measured on
a busy machine):

    OMP_NUM_THREADS=1 python benchmarks/train_draft.py

The draft's shape and its files (`DraftModel`, `init_draft_from_target`, `save_draft`, `load_draft`)
are `minfer.speculative.pruned_draft`, which the engine uses; this module is how the weights were trained.

Load by name: `load_draft("smollm2-135m-draft", target, dtype, device)`. The baseline
"smollm2-135m-draft-undistilled" has the same shape and is exactly the distilled draft's
starting point (the target's layers 0 and 1, pruned, its final norm and its output rows for the
same head tokens), with no training at all: the comparison isolates what distillation adds.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minfer.layers.attention import AttentionFn, causal_mask
from minfer.layers.linear import bf16_autocast
from minfer.models.llama import LlamaModel
# the draft's shape and files live with the engine, which loads the shipped draft; init_draft_from_target and
# load_draft are also imported from here by the chapter 08 notebook
from minfer.speculative.pruned_draft import DraftModel, init_draft_from_target, load_draft  # noqa: F401


def select_head_tokens(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k token ids with the highest counts; ties (e.g. unseen tokens) go to the lower id,
    since a BPE tokenizer numbers its merges in the order it found them frequent."""
    if not 1 <= k <= counts.numel():
        raise ValueError(f"k must be in [1, {counts.numel()}], got {k}")
    return torch.sort(counts, descending=True, stable=True).indices[:k]  # stable: ties keep id order


def final_hidden(model: LlamaModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The normed last hidden state [batch, seq, hidden] of a whole causal sequence, with autograd
    (model.forward runs under inference_mode: fine for serving, useless for training)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    x = model.embed_tokens(input_ids)
    rope = model.rope(positions, x.dtype)
    for i, layer in enumerate(model.layers):
        x = x + layer.self_attn(layer.input_layernorm(x), rope, model.attention_fn, None, None, i)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


@torch.no_grad()  # not inference_mode: the results are training targets, which autograd must be able to save
def teacher_topk(target: LlamaModel, input_ids: torch.Tensor, head_token_ids: torch.Tensor,
                 top_k: int, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits over the head tokens, reduced to their top_k: (values, head indices),
    each [batch, seq, top_k]. Only the K head rows of the output layer are computed.
    bf16: matmuls in bfloat16 (autocast), about 2x faster on CPUs with bf16 instructions (`bf16_autocast`)."""
    with bf16_autocast(input_ids.device.type, bf16):
        hidden = final_hidden(target, input_ids)
        logits = (hidden @ target.lm_head.weight[head_token_ids.to(hidden.device)].T).float()
    values, indices = logits.topk(top_k, dim=-1)
    return values, indices


def distillation_loss(draft_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      teacher_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean over positions of KL(p || q), p = softmax(teacher_logits), q = softmax(draft_logits).

    draft_logits [..., K] over the head tokens. teacher_logits [..., K] over the same tokens, or
    [..., k] for the head columns teacher_indices [..., k] only (the teacher's top-k: p is
    renormalised over them and is 0 elsewhere). Zero exactly when the draft matches the teacher.
    """
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    if teacher_indices is not None:
        log_q = log_q.gather(-1, teacher_indices)
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def train_draft(draft: DraftModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                steps: int, lr: float = 5e-4, warmup: int = 20, bf16: bool = False,
                on_step: Optional[Callable[[int, float], None]] = None) -> list[float]:
    """AdamW on everything but the (shared, frozen) embedding, cosine learning-rate decay.
    bf16: mixed precision where it is faster (`bf16_autocast`; the weights, their updates and the loss stay float32).

    batches yields (input_ids [B, T], teacher values [B, T, k], teacher head indices [B, T, k])
    and is cycled until `steps` steps are done. Returns the loss of each step.
    """
    params = [p for name, p in draft.named_parameters() if not name.startswith("embed_tokens")]
    draft.embed_tokens.weight.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    draft.train()

    def batch_loss(batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ids, values, indices = batch
        with bf16_autocast(ids.device.type, bf16):
            logits = draft.lm_head(final_hidden(draft, ids))
        return distillation_loss(logits, values, indices)

    return run_training(opt, batches, steps, warmup, batch_loss, on_step, clip=params)


def run_training(opt: torch.optim.Optimizer, batches: Iterable, steps: int, warmup: int,
                 batch_loss: Callable[[object], torch.Tensor], on_step: Optional[Callable[[int, float], None]] = None,
                 clip: Optional[list[nn.Parameter]] = None) -> list[float]:
    """The loop every training in minfer shares (the draft's distillation, quantization-aware fine-tuning):
    cycle `batches` until `steps` optimizer steps are done, the learning rate warming up linearly for `warmup`
    steps and decaying along a cosine; clip: parameters whose gradient norm is clipped to 1. Returns each loss."""
    schedule = lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in batches:
            loss = batch_loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(clip, 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(len(losses), losses[-1])
            if len(losses) == steps:
                break
    return losses


@torch.inference_mode()
def greedy_acceptance(draft: DraftModel, target: LlamaModel, input_ids: torch.Tensor,
                      score_mask: Optional[torch.Tensor] = None) -> float:
    """Share of positions where the draft's greedy next token equals the target's: the acceptance
    rate alpha of greedy speculative decoding when input_ids is the target's own greedy text
    (then every context the draft sees while drafting is one the target produced).
    score_mask [batch, seq] picks the positions that count (default: all)."""
    input_ids = input_ids.to(target.embed_tokens.weight.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
    wanted = target(input_ids, positions, last_only=False).argmax(-1)
    proposed = draft.head_token_ids[draft(input_ids, positions, last_only=False).argmax(-1)]
    hits = wanted == proposed
    if score_mask is not None:
        hits = hits[score_mask.to(hits.device)]
    return hits.float().mean().item()


class ChainCache:
    """An EAGLE head's training-time test (EAGLE-3): the j-th guess of every chain at once, as the engine
    makes it (`minfer/speculative/eagle.py`).

    Chain t starts where the target's features end, after position t. In the engine the head's second
    guess reads its own predicted feature, not the target's, and attends to the rows built from the
    target's features plus the earlier guesses of its own chain. Passed as the head's KV cache for
    `depth` calls in a row, this object keeps each call's keys; call j's query for chain t (at position
    t + j - 1) sees call 1's keys at positions <= t and the keys of calls 2..j for chain t alone. The keys
    of each call are kept whole, per layer of the head."""

    def __init__(self) -> None:
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: Optional[torch.Tensor]) -> torch.Tensor:
        keys, values = self.keys.setdefault(layer, []), self.values.setdefault(layer, [])
        keys.append(k)
        values.append(v)
        chains = q.shape[2]
        own_chain = torch.eye(chains, dtype=torch.bool, device=q.device)
        visible = torch.cat([causal_mask(chains, chains, q.device)] + [own_chain] * (len(keys) - 1), dim=1)
        return attention_fn(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), visible[None, None])

    def advance(self, num_tokens: int) -> None:
        pass


def chained_guesses(head: nn.Module, features: torch.Tensor, ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """An EAGLE head's first `depth` guesses of every chain at once (ChainCache): features [batch, chains,
    hidden] the head reads at positions 0..chains-1, ids [batch, chains + 1] the tokens. Guess j of chain t
    reads token t+j+1 at position t+j and exists while t + j < chains (later rows are padding).
    Returns the predicted features of each guess, [batch, chains, hidden] each."""
    chains, guesses = features.shape[1], []
    cache = ChainCache() if depth > 1 else None  # one guess: plain causal attention
    for j in range(depth):
        features = head(features, F.pad(ids[:, 1 + j:], (0, j)), torch.arange(j, chains + j, device=ids.device)[None],
                        cache)
        guesses.append(features)
    return guesses
