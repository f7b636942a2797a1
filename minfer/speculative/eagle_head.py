"""An EAGLE draft head: a decoder layer that reads the target's own features (Li et al., 2024).

A draft model starts from tokens alone and must rebuild what the target knows; an EAGLE head starts
from the target's last hidden state (the last decoder layer's output, before the final norm). At
position t it reads that feature f_t and the embedding of the token at t+1, mixes them
(fc: concat(embedding, feature), 2 x hidden -> hidden), runs one decoder layer of the target's shape
(or num_layers of them) and predicts the feature f_{t+1}. The target's final norm and its output head, restricted to the K
most frequent tokens (as the pruned draft's head), turn that into the next token's guess. To guess
further, the head feeds its own predicted feature back in place of the target's.

EAGLE-3 reads more than the last layer: with feature_layers, the outputs of those earlier decoder
layers and of the last one are mixed into one feature first (fuse: (n + 1) x hidden -> hidden), so
the head sees what the target knew about the context before its last layers turned it towards the
next token alone. Only the target's rows are fused; the head's own guesses are already one feature.

    head = load_eagle("smollm2-135m-eagle", target, dtype, device)
    features = head(head.read_features(target_states), next_token_ids, positions, kv_cache)  # [batch, seq, hidden]
    logits = head.logits(features)          # [batch, seq, K]: head_token_ids maps them to target ids

The file holds only fc, fuse and the layers (bfloat16): the embedding, the final norm and the K output rows
are the target's, taken at load time. `benchmarks/train_eagle.py` trains it.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.layers.attention import AttentionCache, attention_sdpa
from minfer.models.llama import DecoderLayer, LlamaModel, RMSNorm, RotaryEmbedding

EAGLE = "smollm2-135m-eagle"
EAGLE_DIR = Path(__file__).resolve().parent.parent / "drafts" / EAGLE  # package data
OWN_WEIGHTS = ("fc.", "fuse.", "layers.")  # what the file holds; the rest is the target's
SHAPE_KEYS = ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size")


class EagleHead(nn.Module):
    def __init__(self, config: ModelConfig, num_head_tokens: int, feature_layers: tuple[int, ...] = (),
                 num_layers: int = 1) -> None:
        """config: the target's; the head has num_layers decoder layers of that shape. feature_layers: the
        target's earlier decoder layers (0-based) it reads besides the last one."""
        super().__init__()
        self.config = replace(config, num_layers=num_layers, sparse_layers=())
        hidden = config.hidden_size
        self.feature_layers = tuple(feature_layers)
        self.fuse = nn.Linear((len(feature_layers) + 1) * hidden, hidden, bias=False) if feature_layers else None
        self.embed_tokens = nn.Embedding(0, hidden)  # a placeholder: the target lends its own
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList(DecoderLayer(self.config, i) for i in range(num_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, num_head_tokens, bias=False)
        self.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.register_buffer("head_token_ids", torch.zeros(num_head_tokens, dtype=torch.long), persistent=False)
        self.attention_fn = attention_sdpa

    def read_features(self, states: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [..., (len(feature_layers) + 1) x hidden] -> the feature the head reads."""
        return states if self.fuse is None else self.fuse(states.to(self.fuse.weight.dtype))

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: Optional[AttentionCache] = None) -> torch.Tensor:
        """features [batch, seq, hidden] at positions t, input_ids [batch, seq] the tokens at t+1 ->
        the predicted features at t+1 [batch, seq, hidden] (differentiable: training calls it too)."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        rope = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), rope, self.attention_fn, None, kv_cache, i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        return x

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's final norm and its K head rows: float32 logits over head_token_ids."""
        return self.lm_head(self.norm(features)).float()


def _check_shape(meta: dict, target: LlamaModel, name: str) -> None:
    mismatched = [k for k in SHAPE_KEYS if meta.get(k) != getattr(target.config, k)]
    if mismatched:
        got = ", ".join(f"{k} {meta.get(k)}" for k in mismatched)
        allowed = ", ".join(f"{k} {getattr(target.config, k)}" for k in mismatched)
        raise ValueError(f"EAGLE head {name!r} was trained for a target with {got}; this target has {allowed}: "
                         "an EAGLE head only fits the model it was trained on")


@torch.no_grad()
def eagle_from_target(target: LlamaModel, head_token_ids: torch.Tensor, feature_layers: tuple[int, ...] = (),
                      num_layers: int = 1) -> EagleHead:
    """A fresh head for `target` (its layers randomly initialised): the target's embedding (shared), its
    final norm (a copy) and its output rows for head_token_ids (a copy), all three frozen. fuse starts
    by passing the last layer's output through unchanged: a head trained on the last layer alone can go on
    learning from there."""
    bad = [i for i in feature_layers if not 0 <= i < target.config.num_layers - 1]
    if bad:
        raise ValueError(f"feature_layers {bad}: an EAGLE head reads earlier layers of the target, "
                         f"0..{target.config.num_layers - 2} here (the last one it reads anyway)")
    if not isinstance(target.lm_head, nn.Linear):
        raise ValueError("an EAGLE head copies the target's float output rows: use an unquantized target")
    weight = target.embed_tokens.weight
    if num_layers < 1:
        raise ValueError(f"an EAGLE head has at least one decoder layer, got num_layers={num_layers}")
    head = EagleHead(target.config, len(head_token_ids), feature_layers, num_layers).to(device=weight.device,
                                                                                      dtype=weight.dtype)
    if head.fuse is not None:
        hidden = target.config.hidden_size
        head.fuse.weight.zero_()
        head.fuse.weight[:, -hidden:] = torch.eye(hidden)
    head.embed_tokens = target.embed_tokens
    head.norm.weight.copy_(target.norm.weight)
    head.lm_head.weight.copy_(target.lm_head.weight[head_token_ids.to(weight.device)])
    head.head_token_ids.copy_(head_token_ids)
    head.attention_fn = target.attention_fn
    for module in (head.norm, head.lm_head):
        module.requires_grad_(False)
    return head


def save_eagle(head: EagleHead, folder: str | os.PathLike, meta: dict) -> None:
    """Write fc, fuse and the layers in bfloat16, and the config (the shape, num_layers, feature_layers,
    head_token_ids, `meta`)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()
               if k.startswith(OWN_WEIGHTS)}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config = {**{k: getattr(head.config, k) for k in SHAPE_KEYS}, "method": "eagle", **meta,
              "num_layers": head.config.num_layers, "feature_layers": list(head.feature_layers),
              "head_token_ids": head.head_token_ids.tolist()}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def is_eagle(name_or_path: str) -> bool:
    """The shipped head's name, or a folder written by save_eagle."""
    config = Path(name_or_path) / "config.json"
    if name_or_path == EAGLE:
        return True
    return config.is_file() and json.loads(config.read_text()).get("method") == "eagle"


def load_eagle(name_or_path: str, target: LlamaModel) -> EagleHead:
    """The EAGLE head for `target`, by name (EAGLE) or from a folder written by save_eagle, in the
    target's dtype and on its device (it reads the target's features and shares its embedding)."""
    from safetensors.torch import load_file

    folder = EAGLE_DIR if name_or_path == EAGLE else Path(name_or_path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"no EAGLE head at {name_or_path!r}: use {EAGLE!r} or a folder written by save_eagle")
    meta = json.loads((folder / "config.json").read_text())
    _check_shape(meta, target, name_or_path)
    head = eagle_from_target(target, torch.tensor(meta["head_token_ids"], dtype=torch.long),
                             tuple(meta.get("feature_layers", ())), meta.get("num_layers", 1))
    tensors = load_file(str(folder / "model.safetensors"))
    own = {k for k in head.state_dict() if k.startswith(OWN_WEIGHTS)}
    if set(tensors) != own:
        raise ValueError(f"{folder} does not hold an EAGLE head of this shape: expected {sorted(own)}, "
                         f"found {sorted(tensors)}")
    head.load_state_dict(tensors, strict=False)
    return head.eval()
