"""Chapter 02: the KV cache, what it saves and what it costs.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch02")` in the
notebook.
"""
from __future__ import annotations

import torch

from minfer.kv_cache import KVCache  # noqa: F401  (for greedy_decode)
from minfer.models.llama import LlamaModel


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes one token costs: a key and a value vector per KV head, in every layer."""
    raise NotImplementedError("write me")


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   context_len: int, batch_size: int = 1) -> int:
    """Cache bytes for batch_size sequences of context_len tokens each."""
    raise NotImplementedError("write me")


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k_new, v_new [batch, kv_heads, n, head_dim] into the caches [batch, kv_heads, max_len, head_dim]
    at positions start..start+n-1, in place, and return the filled part, [..., :start+n, :], of each.

    Raises ValueError when the cache is too short.
    """
    raise NotImplementedError("write me")


def cached_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, start: int) -> torch.Tensor:
    """Attention for n new tokens at positions start..start+n-1, given the cache of the tokens before.

    q [batch, num_heads, n, head_dim]; k_new, v_new [batch, num_kv_heads, n, head_dim]; caches as
    in `append_kv`. Stores the new keys/values, then lets each new query see every cached token
    and the new tokens up to itself. Returns [batch, num_heads, n, head_dim].
    """
    raise NotImplementedError("write me")


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
    raise NotImplementedError("write me")
