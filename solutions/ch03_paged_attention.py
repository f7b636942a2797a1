"""Chapter 03, worked: paged attention, from block tables to the kernel's online softmax."""
from __future__ import annotations

import math
from typing import Optional

import torch


def slot_for(block_table: list[int], position: int, block_size: int) -> int:
    """The flat pool slot of a sequence's token at `position`.

    Token `position` lives in block `block_table[position // block_size]`, at offset
    `position % block_size` inside it; the slot is block * block_size + offset. Raises IndexError
    when the table has no block for that position.
    """
    if position < 0:
        raise IndexError(f"position {position} is negative")
    return block_table[position // block_size] * block_size + position % block_size


def grow_block_table(block_table: list[int], free_blocks: list[int], num_tokens: int, block_size: int) -> None:
    """Give a sequence the blocks it needs to hold num_tokens tokens, in place.

    Appends block ids taken from the *front* of free_blocks (and removes them from it) until
    block_table has ceil(num_tokens / block_size) blocks; a table that is already long enough is
    left alone. When there are too few free blocks, raises RuntimeError and changes nothing.
    """
    missing = -(-num_tokens // block_size) - len(block_table)
    if missing > len(free_blocks):
        raise RuntimeError(f"{missing} more blocks needed, {len(free_blocks)} free")
    for _ in range(max(missing, 0)):
        block_table.append(free_blocks.pop(0))


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: list[int],
                    context_len: int, scale: Optional[float] = None) -> torch.Tensor:
    """Decode attention of one query token over its sequence's paged keys and values.

    q [num_heads, head_dim]; k_pool, v_pool [num_blocks, block_size, num_kv_heads, head_dim];
    the sequence's first context_len tokens live in the blocks of block_table, in order. Query head
    h reads KV head h // (num_heads // num_kv_heads) (grouped-query attention). scale defaults to
    1/sqrt(head_dim). Returns softmax(q·k * scale) @ v over the context_len tokens, [num_heads, head_dim].
    """
    num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[1], k_pool.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    slots = torch.tensor([slot_for(block_table, p, block_size) for p in range(context_len)], dtype=torch.long)
    k = k_pool.flatten(0, 1)[slots].float()  # gather: [context_len, num_kv_heads, head_dim]
    v = v_pool.flatten(0, 1)[slots].float()
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # one KV head per query head
    scores = torch.einsum("hd,nhd->hn", q.float(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                             scale: Optional[float] = None) -> torch.Tensor:
    """softmax(k @ q * scale) @ v for one query, reading k and v chunk_size rows at a time.

    q [head_dim]; k, v [n, head_dim]; scale defaults to 1/sqrt(head_dim). Keep only a running
    maximum m, a running sum l of exp(score - m) and a running output acc = sum exp(score - m) * v;
    rescale them by exp(m_old - m_new) when a chunk raises the maximum. Never build the softmax
    of all n scores at once (no torch.softmax). Returns [head_dim].
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    m = torch.tensor(float("-inf"))
    l = torch.tensor(0.0)
    acc = torch.zeros(v.shape[-1])
    for start in range(0, k.shape[0], chunk_size):
        scores = (k[start:start + chunk_size].float() @ q.float()) * scale
        m_new = torch.maximum(m, scores.max())
        alpha = torch.exp(m - m_new)  # 0 on the first chunk: exp(-inf)
        p = torch.exp(scores - m_new)
        l = l * alpha + p.sum()
        acc = acc * alpha + p @ v[start:start + chunk_size].float()
        m = m_new
    return (acc / l).to(q.dtype)
