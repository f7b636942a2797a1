"""Chapter 02, worked: the KV cache, what it saves and what it costs.

A token's key and value never change once computed: later tokens only add rows. Keeping them
turns each decode step from "run the whole sequence again" into "run one token and read the
rest", at the price of memory that grows with every token of every sequence.
"""
from __future__ import annotations

import torch

from minfer.kv_cache import KVCache
from minfer.layers.attention import attention_reference
from minfer.models.llama import LlamaModel


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes one token costs: a key and a value vector per KV head, in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   context_len: int, batch_size: int = 1) -> int:
    """Cache bytes for batch_size sequences of context_len tokens each."""
    return kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) * context_len * batch_size


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k_new, v_new [batch, kv_heads, n, head_dim] into the caches [batch, kv_heads, max_len, head_dim]
    at positions start..start+n-1, in place, and return the filled part, [..., :start+n, :], of each.

    Raises ValueError when the cache is too short.
    """
    end = start + k_new.shape[2]
    if end > k_cache.shape[2]:
        raise ValueError(f"cache holds {k_cache.shape[2]} tokens, {end} needed")
    k_cache[:, :, start:end] = k_new
    v_cache[:, :, start:end] = v_new
    # slices are views: no copy, and what the next step writes stays out of this step's view
    return k_cache[:, :, :end], v_cache[:, :, :end]


def cached_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
    """Attention for n new tokens at positions start..start+n-1, given the cache of the tokens before.

    q [batch, num_heads, n, head_dim]; k_new, v_new [batch, num_kv_heads, n, head_dim]; caches as
    in `append_kv`. Stores the new keys/values, then lets each new query see every cached token
    and the new tokens up to itself. Returns [batch, num_heads, n, head_dim].
    """
    k, v = append_kv(k_cache, v_cache, k_new, v_new, start)
    # the queries are the last n of the start+n keys: exactly the contract's default causal mask
    return attention_reference(q, k, v, None)


def greedy_decode(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int, use_cache: bool = True) -> list[int]:
    """Generate exactly max_new_tokens greedy tokens (end-of-sequence is not special) for one prompt.

    Without a cache every step runs the model over the whole sequence so far. With one
    (minfer.kv_cache.KVCache), the first step runs the prompt and later steps run only the
    newest token. `model(ids, positions, cache)` takes ids and positions [1, n] and returns the
    logits of the last position [1, 1, vocab]; it writes the new keys and values into the cache and
    advances cache.length itself (do not call cache.advance). Build the ids, positions and cache on
    the model's device and dtype (those of model.embed_tokens.weight). Returns the max_new_tokens new
    ids, without the prompt.
    """
    device = model.embed_tokens.weight.device
    tokens = list(prompt_ids)
    cache = None
    if use_cache:
        cache = KVCache(model.config, 1, len(tokens) + max_new_tokens, model.embed_tokens.weight.dtype, device)
    known = 0  # tokens whose keys and values the cache already holds
    for _ in range(max_new_tokens):
        ids = torch.tensor([tokens[known:]], device=device)
        positions = torch.arange(known, len(tokens), device=device)[None]
        logits = model(ids, positions, cache)  # the model appends to the cache and advances it
        if use_cache:
            known = len(tokens)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt_ids):]
