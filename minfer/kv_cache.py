"""A contiguous, preallocated KV cache: one slab per layer, written in place as tokens arrive.

Without it every new token recomputes K and V for the whole sequence (O(n^2) work over a
generation); with it each step computes K and V for one token and reads the rest (O(n)).
The price is memory: 2 x layers x kv_heads x head_dim x bytes per token, reserved up front
for the longest sequence the batch may reach.
"""
from __future__ import annotations

from typing import Optional

import torch

from minfer.config import ModelConfig
from minfer.layers.attention import AttentionFn


class KVCache:
    def __init__(self, config: ModelConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens already stored (the same for every row: prompts are left-padded)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v [batch, kv_heads, new, head_dim]; return all visible keys/values."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} tokens > {self.max_len} reserved")
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Store the new k, v, then let the new queries attend over everything stored so far."""
        k_all, v_all = self.update(layer, k, v)
        return attention_fn(q, k_all, v_all, mask)

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
