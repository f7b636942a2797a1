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

Load by name: `load_draft("smollm2-135m-draft", target, dtype, device)`. The baseline
"smollm2-135m-draft-undistilled" has the same shape and is exactly the distilled draft's
starting point (the target's layers 0 and 1, pruned, its final norm and its output rows for the
same head tokens), with no training at all: the comparison isolates what distillation adds.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from minfer.config import ModelConfig
from minfer.layers.linear import bf16_autocast
from minfer.models.llama import LlamaModel, RotaryEmbedding

DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"  # minfer/drafts (package data)
DISTILLED = "smollm2-135m-draft"
KNOWN_DRAFTS = (DISTILLED, "smollm2-135m-draft-undistilled")


class DraftModel(LlamaModel):
    """A LlamaModel whose head has K rows: row i scores the target token `head_token_ids[i]`."""

    def __init__(self, config: ModelConfig, num_head_tokens: int) -> None:
        if config.tie_word_embeddings:
            raise ValueError("a draft with a top-K head cannot tie its head to the full embedding")
        super().__init__(config)
        self.lm_head = nn.Linear(config.hidden_size, num_head_tokens, bias=False)
        self.register_buffer("head_token_ids", torch.zeros(num_head_tokens, dtype=torch.long), persistent=False)


def select_head_tokens(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k token ids with the highest counts; ties (e.g. unseen tokens) go to the lower id,
    since a BPE tokenizer numbers its merges in the order it found them frequent."""
    if not 1 <= k <= counts.numel():
        raise ValueError(f"k must be in [1, {counts.numel()}], got {k}")
    return torch.sort(counts, descending=True, stable=True).indices[:k]  # stable: ties keep id order


def prune_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, keep: int):
    """Keep the `keep` SwiGLU neurons with the largest |gate_j| |up_j| |down_:,j| (in their order)."""
    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    idx = score.topk(keep).indices.sort().values
    return gate[idx], up[idx], down[:, idx]


def empty_draft(config: ModelConfig, num_head_tokens: int, device="cpu", dtype=torch.float32) -> DraftModel:
    """A DraftModel with uninitialised weights (built on the meta device: no wasted random init)."""
    with torch.device("meta"):
        draft = DraftModel(config, num_head_tokens)
        draft.embed_tokens = nn.Embedding(0, config.hidden_size)  # a placeholder: the target lends its own
    draft = draft.to_empty(device=device).to(dtype)
    draft.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta).to(device)
    return draft


@torch.no_grad()
def init_draft_from_target(target: LlamaModel, layers_from: list[int], intermediate_size: int,
                           head_token_ids: torch.Tensor) -> DraftModel:
    """Copy target layers `layers_from` (MLPs pruned to intermediate_size), its final norm, and
    the target's head rows for head_token_ids. The embedding is the target's, shared."""
    if not all(isinstance(m, nn.Linear) for m in (target.lm_head, target.layers[0].mlp.down_proj)):
        raise ValueError("this draft copies the target's float weights: build it from an unquantized target")
    config = replace(target.config, num_layers=len(layers_from), intermediate_size=intermediate_size,
                     tie_word_embeddings=False)
    device, dtype = target.embed_tokens.weight.device, target.embed_tokens.weight.dtype
    draft = empty_draft(config, len(head_token_ids), device, dtype)
    draft.embed_tokens = target.embed_tokens
    for mine, i in zip(draft.layers, layers_from):
        theirs = target.layers[i]
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn"):
            getattr(mine, name).load_state_dict(getattr(theirs, name).state_dict())
        inter = target.config.intermediate_size
        gate, up = theirs.mlp.gate_up_proj.weight.split(inter)
        gate, up, down = prune_mlp(gate, up, theirs.mlp.down_proj.weight, intermediate_size)
        mine.mlp.gate_up_proj.weight.copy_(torch.cat([gate, up]))
        mine.mlp.down_proj.weight.copy_(down)
    draft.norm.load_state_dict(target.norm.state_dict())
    draft.lm_head.weight.copy_(target.lm_head.weight[head_token_ids.to(device)])
    draft.head_token_ids.copy_(head_token_ids)
    return draft.eval()


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


def save_draft(draft: DraftModel, folder: str | os.PathLike, meta: dict) -> None:
    """Write the draft's own weights in bfloat16 (not the shared embedding) and its config."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()
               if not k.startswith("embed_tokens")}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config = {"num_layers": draft.config.num_layers, "intermediate_size": draft.config.intermediate_size,
              "hidden_size": draft.config.hidden_size, "vocab_size": draft.config.vocab_size,
              **meta, "head_token_ids": draft.head_token_ids.tolist()}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def load_draft(name_or_path: str, target: LlamaModel, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> DraftModel:
    """A draft for `target` by name (see KNOWN_DRAFTS) or from a folder written by save_draft.

    The returned model's forward gives logits over its head tokens; `head_token_ids` maps them
    to target token ids. It shares the target's embedding when dtype and device match.
    """
    folder = DRAFTS_DIR / DISTILLED if name_or_path in KNOWN_DRAFTS else Path(str(name_or_path))
    if not (folder / "config.json").is_file():
        raise ValueError(f"unknown draft model {name_or_path!r}: use one of {list(KNOWN_DRAFTS)} "
                         "or a folder with config.json and model.safetensors from minfer.spec.distill.save_draft")
    meta = json.loads((folder / "config.json").read_text())
    if (meta["hidden_size"], meta["vocab_size"]) != (target.config.hidden_size, target.config.vocab_size):
        raise ValueError(f"draft {name_or_path!r} fits a target with hidden size {meta['hidden_size']} and "
                         f"vocabulary {meta['vocab_size']}, not this one "
                         f"({target.config.hidden_size}, {target.config.vocab_size})")
    head_ids = torch.tensor(meta["head_token_ids"], dtype=torch.long)
    if name_or_path == "smollm2-135m-draft-undistilled":  # the starting point, untrained
        draft = init_draft_from_target(target, meta["layers_from"], meta["intermediate_size"], head_ids)
    else:
        from safetensors.torch import load_file

        config = replace(target.config, num_layers=meta["num_layers"], intermediate_size=meta["intermediate_size"],
                         tie_word_embeddings=False)
        draft = empty_draft(config, len(head_ids))
        missing, unexpected = draft.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
        if unexpected or set(missing) != {"embed_tokens.weight"}:
            raise ValueError(f"{folder} does not hold a draft of this shape (missing {missing}, unexpected {unexpected})")
        draft.head_token_ids.copy_(head_ids)
    embedding = target.embed_tokens
    draft.embed_tokens = nn.Embedding(0, target.config.hidden_size)  # so .to() cannot convert the target's
    draft = draft.to(device=device, dtype=dtype)
    if embedding.weight.dtype == dtype and embedding.weight.device == draft.lm_head.weight.device:  # cuda == cuda:0
        draft.embed_tokens = embedding  # one copy of the 49152 x 576 table serves both models
    else:
        draft.embed_tokens = nn.Embedding.from_pretrained(embedding.weight.detach().to(device=device, dtype=dtype))
    draft.attention_fn = target.attention_fn
    return draft.eval()
