"""Attention backends: the model calls one of these and never cares which.

Every backend has the same contract, so a learner's function or a Triton kernel plugs in
without touching the model:

    attention_fn(q, k, v, mask) -> out
      q:    [batch, num_heads, q_len, head_dim]     queries of the new tokens
      k, v: [batch, num_kv_heads, kv_len, head_dim] keys/values of every visible token
      mask: [batch, 1, q_len, kv_len] bool, True where a query may look, or None meaning
            "causal, with the queries being the last q_len keys" (the common case)
      out:  [batch, num_heads, q_len, head_dim]

num_heads is a multiple of num_kv_heads (grouped-query attention): query head h reads
KV head h // (num_heads // num_kv_heads).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Protocol

import torch
import torch.nn.functional as F

from minfer.layers.linear import bf16_matmuls_fast

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


class AttentionCache(Protocol):
    """What the model asks of a KV cache (the contiguous `KVCache`, or the engine's paged step).

    attend: store this layer's new k, v [batch, kv_heads, new, head_dim] where the cache keeps
    them, then return the attention of the new queries q over everything the cache holds
    (shaped like q). advance: called once per forward pass, after the last layer.
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: Optional[torch.Tensor]) -> torch.Tensor: ...

    def advance(self, num_tokens: int) -> None: ...


def causal_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """[q_len, kv_len] bool: query i (the (kv_len - q_len + i)-th token) sees keys up to itself."""
    offset = kv_len - q_len
    rows = torch.arange(q_len, device=device)[:, None] + offset
    return torch.arange(kv_len, device=device)[None, :] <= rows


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Plain attention, written out: the definition every other backend is tested against."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # share each KV head with its group of query heads
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is None:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


# From this many decoding sequences on, two batched matmuls beat the fused kernel on CPU (2 threads,
# 320 keys, measured): bfloat16 1.0x at 8 sequences, 1.6x at 16 and 32; float32 1.0x at 8, 1.15x at
# 16. Below it the fused kernel wins (1.8x at one sequence): fewer, larger calls.
DECODE_MATMUL_MIN_BATCH = 8


def decode_attention_matmul(grouped: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: Optional[torch.Tensor]) -> torch.Tensor:
    """One query per sequence, written as two matmuls batched over sequences and KV heads.

    grouped [batch, kv_heads, group, dim] (the query heads of each KV head), k/v [batch, kv_heads,
    kv_len, dim], mask [batch, 1, 1, kv_len] or None -> [batch, kv_heads, group, dim]. The two batch
    axes are walked in the order K/V lie in memory (KV head first for the paged pool's gathers,
    sequence first for a contiguous cache), so that matmul copies nothing. Scores in the model's
    dtype, softmax in float32, as transformers' eager attention; bfloat16 where its matmuls are slow
    (no bf16 instructions: 39.7 against 13.7 ms of matmuls per 8-sequence step) is widened to float32.
    """
    dtype = grouped.dtype
    heads_first = k.stride(1) > k.stride(0)
    if heads_first:
        grouped, k, v = grouped.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        mask = None if mask is None else mask.transpose(0, 1)
    if dtype == torch.bfloat16 and not bf16_matmuls_fast(grouped.device.type):
        grouped, k, v = grouped.float(), k.float(), v.float()  # strides kept: still no copy inside matmul
    scores = (grouped / math.sqrt(grouped.shape[-1])) @ k.transpose(-1, -2)  # scale the few queries, not the scores
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = (torch.softmax(scores, dim=-1, dtype=torch.float32).to(grouped.dtype) @ v).to(dtype)
    return out.transpose(0, 1) if heads_first else out


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The default backend: PyTorch's fused scaled_dot_product_attention, but two batched matmuls
    for decoding many sequences at once (`decode_attention_matmul`), where they are faster on CPU."""
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q_len == 1:
        # Decode. Each KV head serves a group of query heads: fold the group into the query axis
        # ([batch, kv_heads, group, dim]) instead of repeating K/V for every query head.
        # A new token may see every stored key, so only a padding mask [batch, 1, 1, kv] can apply.
        grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if batch < DECODE_MATMUL_MIN_BATCH:
            return F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).reshape(batch, num_heads, 1, head_dim)
        return decode_attention_matmul(grouped, k, v, mask).reshape(batch, num_heads, 1, head_dim)
    if mask is None:
        kv_len = k.shape[2]
        if q_len == kv_len:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = causal_mask(q_len, kv_len, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "reference": attention_reference,
    "sdpa": attention_sdpa,
}


def get_attention_fn(attention: str | AttentionFn) -> AttentionFn:
    if callable(attention):
        return attention
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {attention!r}: use one of {sorted(ATTENTION_BACKENDS)} or a function")
    return ATTENTION_BACKENDS[attention]
