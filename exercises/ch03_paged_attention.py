"""Chapter 03: paged attention, from block tables to the kernel's online softmax.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch03")` in the
notebook.
"""
from __future__ import annotations

from typing import Optional

import torch


def slot_for(block_table: list[int], position: int, block_size: int) -> int:
    """The flat pool slot of a sequence's token at `position`.

    Token `position` lives in block `block_table[position // block_size]`, at offset
    `position % block_size` inside it; the slot is block * block_size + offset. Raises IndexError
    when the table has no block for that position.
    """
    raise NotImplementedError("write me")


def grow_block_table(block_table: list[int], free_blocks: list[int], num_tokens: int, block_size: int) -> None:
    """Give a sequence the blocks it needs to hold num_tokens tokens, in place.

    Appends block ids taken from the *front* of free_blocks (and removes them from it) until
    block_table has ceil(num_tokens / block_size) blocks; a table that is already long enough is
    left alone. When there are too few free blocks, raises RuntimeError and changes nothing.
    """
    raise NotImplementedError("write me")


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: list[int],
                    context_len: int, scale: Optional[float] = None) -> torch.Tensor:
    """Decode attention of one query token over its sequence's paged keys and values.

    q [num_heads, head_dim]; k_pool, v_pool [num_blocks, block_size, num_kv_heads, head_dim];
    the sequence's first context_len tokens live in the blocks of block_table, in order. Query head
    h reads KV head h // (num_heads // num_kv_heads) (grouped-query attention). scale defaults to
    1/sqrt(head_dim). Returns softmax(q·k * scale) @ v over the context_len tokens, [num_heads, head_dim].
    """
    raise NotImplementedError("write me")


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                             scale: Optional[float] = None) -> torch.Tensor:
    """softmax(k @ q * scale) @ v for one query, reading k and v chunk_size rows at a time.

    q [head_dim]; k, v [n, head_dim]; scale defaults to 1/sqrt(head_dim). Keep only a running
    maximum m, a running sum l of exp(score - m) and a running output acc = sum exp(score - m) * v;
    rescale them by exp(m_old - m_new) when a chunk raises the maximum. Never build the softmax
    of all n scores at once (no torch.softmax). Returns [head_dim].
    """
    raise NotImplementedError("write me")
