"""The shipped draft's shape and files: what the engine needs to serve a distilled draft (chapter 08).

    load_draft("smollm2-135m-draft", target, dtype, device)     # LLM(..., speculative_model="smollm2-135m-draft")

A `DraftModel` is two decoder layers copied from the target (their MLP pruned to the neurons with
the largest weights), the target's final norm, and an output head over only the K most frequent
tokens; the embedding is the target's own, shared at load time, so a saved draft holds only the
layers, the norm and the K head rows (`save_draft`, `load_draft`). "smollm2-135m-draft-undistilled"
is the same shape built from the target with no training (`init_draft_from_target`).

How the shipped weights were trained (the loss, the teacher's top-k, the training loop) is
`minfer.lab.distill`, course code that builds on this module; the engine never imports it.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from minfer.config import ModelConfig
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


def prune_mlp(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, keep: int):
    """Keep the `keep` SwiGLU neurons with the largest |gate_j| |up_j| |down_:,j| (in their order)."""
    score = gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)
    idx = score.topk(keep).indices.sort().values
    return gate[idx], up[idx], down[:, idx]


def empty_draft(config: ModelConfig, num_head_tokens: int, device="cpu", dtype=torch.float32) -> DraftModel:
    """A DraftModel with uninitialised weights (built on the meta device: no wasted random init)."""
    with torch.device("meta"):
        draft = DraftModel(config, num_head_tokens)
        # a placeholder: the target lends its own (given as _weight: no init to run, on "meta" or anywhere)
        draft.embed_tokens = nn.Embedding(0, config.hidden_size, _weight=torch.empty(0, config.hidden_size))
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
                         "or a folder with config.json and model.safetensors from minfer.speculative.pruned_draft.save_draft")
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
