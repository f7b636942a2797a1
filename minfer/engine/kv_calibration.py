"""The ranges of K and V that an fp8 KV pool's static scales are set from (`minfer/formats/kv.py`).

An fp8 pool keeps one scale per (layer, KV head) for all its tokens, so the scale must be known
before the first token is stored. The engine runs the model once over a calibration text (the
pydoc topics AWQ and GPTQ calibrate on, kept apart from the evaluation text) with a stand-in for
the KV cache that stores nothing: it only records each layer's largest |k| and |v| per KV head,
then attends causally within the pass as an uncached forward would.
"""
from __future__ import annotations

from typing import Optional

import torch

from minfer.layers.attention import AttentionFn
from minfer.texts import calibration_token_ids

KV_CALIBRATION_TOKENS = 512  # ~2 s for SmolLM2-135M on a loaded CPU core; its largest |k|, |v| grow by up
# to ~40 % from 512 to 2048 tokens, which the scales' headroom (FP8_HEADROOM, 4x) covers


class KVRangeRecorder:
    """An `AttentionCache` that keeps nothing and records max |k|, |v| per (layer, KV head)."""

    def __init__(self, num_layers: int, num_kv_heads: int, device: torch.device | str) -> None:
        self.k_amax = torch.zeros(num_layers, num_kv_heads, device=device)
        self.v_amax = torch.zeros(num_layers, num_kv_heads, device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """k, v [batch, kv_heads, tokens, head_dim]: record, then attend causally (mask None)."""
        for amax, new in ((self.k_amax, k), (self.v_amax, v)):
            amax[layer] = torch.maximum(amax[layer], new.detach().abs().amax(dim=(0, 2, 3)).float())
        return attention_fn(q, k, v, mask)

    def advance(self, num_tokens: int) -> None:
        """Nothing is kept between passes."""


def calibration_ids(tokenizer, max_len: int, num_tokens: int = KV_CALIBRATION_TOKENS) -> list[int]:
    """The first min(num_tokens, max_len) tokens of the quantizers' calibration text (`minfer.texts`)."""
    return calibration_token_ids(tokenizer, min(num_tokens, max_len))


@torch.no_grad()
def kv_ranges(model, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest |k| and |v| per (layer, KV head), float32 [num_layers, num_kv_heads] each, over one
    forward pass of ``token_ids`` through ``model``."""
    if not token_ids:
        raise ValueError("kv_ranges needs at least one calibration token")
    device = model.embed_tokens.weight.device
    recorder = KVRangeRecorder(model.config.num_layers, model.config.num_kv_heads, device)
    ids = torch.tensor([token_ids], device=device)
    model(ids, torch.arange(len(token_ids), device=device)[None], recorder)
    return recorder.k_amax, recorder.v_amax
