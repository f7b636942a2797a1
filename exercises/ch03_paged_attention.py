"""Chapter 03: paged attention, from block tables to the kernel's online softmax.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch03")` in the
notebook.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton  # noqa: F401  (for the Triton ladder at the end of this file)
import triton.language as tl  # noqa: F401


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
    1/sqrt(head_dim). Returns softmax(q·k * scale) @ v over the context_len tokens, [num_heads, head_dim],
    in q's dtype (compute in float32).
    """
    raise NotImplementedError("write me")


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_size: int,
                             scale: Optional[float] = None) -> torch.Tensor:
    """softmax(k @ q * scale) @ v for one query, reading k and v chunk_size rows at a time.

    q [head_dim]; k, v [n, head_dim]; scale defaults to 1/sqrt(head_dim). Keep only a running
    maximum m, a running sum l of exp(score - m) and a running output acc = sum exp(score - m) * v;
    rescale them by exp(m_old - m_new) when a chunk raises the maximum. Never build the softmax
    of all n scores at once (no torch.softmax). Returns [head_dim] in q's dtype (compute in float32).
    """
    raise NotImplementedError("write me")


# ----------------------------------------------------------------- the Triton ladder
# Three kernels, each one step closer to minfer/kernels/paged_decode_attention.py, then a fourth, the
# prefill kernel of minfer/kernels/paged_prefill_attention.py in its simplest form. On a CPU they run
# under Triton's interpreter: the notebook sets TRITON_INTERPRET=1 before triton is first imported (in a
# shell of your own, set it too, or Triton stops with '0 active drivers'). BLOCK_SIZE is the cache's block
# size (any integer); BLOCK_N, BLOCK_D are tile sizes (powers of two, as tl.arange wants).
# Each function below is the launcher: write a @triton.jit kernel above it, then replace the
# `raise` with the launch. Plain Python helpers you add need a leading underscore (every public
# function in this file is an exercise with a worked twin in solutions/); @triton.jit ones do not.


def softmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, dim=1) of a 2-D float32 tensor, computed by a Triton kernel with one program per row.

    x [rows, cols] (cols >= 1), its rows contiguous (x.stride(1) == 1) but possibly spaced apart
    (any x.stride(0)). Each program loads its whole row (padded to a power of two, the padding
    masked off), subtracts the row's maximum, and divides the exponentials by their sum. Returns a
    new [rows, cols] tensor.

    A kernel of this shape does it:

        @triton.jit
        def _softmax_rows_kernel(x_ptr, out_ptr, n_cols, stride_x_row, stride_out_row, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            ...  # tl.load with mask=cols < n_cols and other=float("-inf"); tl.max, tl.exp, tl.sum; tl.store

        _softmax_rows_kernel[(rows,)](x, out, cols, x.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(cols))
    """
    raise NotImplementedError("write me")


def online_softmax_tile_triton(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile of the online-softmax update, by a Triton kernel with one program per query row.

    m, l [rows]: each row's running maximum and running sum of exp(score - m) over the keys seen so
    far (-inf and 0 before the first tile); acc [rows, D]: the running sum of exp(score - m) * v;
    scores [rows, N]: the rows' scores against this tile's N keys, -inf where a key must not count;
    v [N, D]: the tile's values. All float32; each row contiguous, rows possibly apart (pass the
    strides: scores may be a slice of a wider score matrix). Every row must have a finite m or
    at least one finite score. Returns new tensors (m', l', acc'): the state over the keys seen so
    far plus this tile, so that acc' / l' is the softmax-weighted mean of all their values. Write
    the step itself as a @triton.jit function of (m, l, acc, scores, v) so the paged kernel can
    call it in its loop.

    Two pieces:

        @triton.jit
        def online_softmax_step(m, l, acc, scores, v):   # m, l scalars; acc [D]; scores [N]; v [N, D]
            ...
            return m_new, l_new, acc_new

        @triton.jit
        def _online_softmax_tile_kernel(m_ptr, l_ptr, acc_ptr, scores_ptr, v_ptr, m_out_ptr, l_out_ptr, acc_out_ptr,
                                        n_keys, head_dim, stride_acc_row, stride_scores_row, stride_v_key,
                                        stride_acc_out_row, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
            ...  # load this row's state, its scores (padding: -inf) and the tile of v (padding: 0), step, store

    Mind the padding: a padded key must add nothing, so load its score as -inf and its value as 0.
    Rows of acc may lie further apart than head_dim (a slice of a wider tensor): read each tensor with its
    own row stride, and write acc_out with acc_out's.
    """
    raise NotImplementedError("write me")


def paged_attention_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: Optional[float] = None, block_n: int = 16) -> torch.Tensor:
    """Paged decode attention by a Triton kernel: the engine's ``paged_decode_attention`` contract.

    q [num_seqs, num_heads, head_dim]; k_pool, v_pool [num_blocks, block_size, num_kv_heads, head_dim]
    (any strides, head_dim contiguous); block_tables int32 [num_seqs, max_blocks]; context_lens int32
    [num_seqs], each >= 1. Query head h reads KV head h // (num_heads // num_kv_heads); scale
    defaults to 1/sqrt(head_dim). One program per (sequence, query head) walks positions
    0..context_len-1 in tiles of block_n (a power of two, independent of block_size): it looks each
    position up in the block table, loads that tile's K and V, and folds it in with the online
    softmax step of the previous rung. Returns [num_seqs, num_heads, head_dim] in q's dtype.

    The loop, in outline (grid: (num_seqs, num_heads)):

        for start in range(0, context_len, BLOCK_N):
            positions = start + tl.arange(0, BLOCK_N)
            ...  # block = table[positions // BLOCK_SIZE], a masked load: past context_len the index runs off
            ...  # the table's row; address (block, positions % BLOCK_SIZE, kv_head)
            ...  # with the pools' strides; load K, V; scores = sum(k * q) * scale, -inf past context_len
            m, l, acc = online_softmax_step(m, l, acc, scores, v)

    Start from m = tl.full([], float("-inf"), tl.float32), l = tl.zeros([], tl.float32) and
    acc = tl.zeros([BLOCK_D], tl.float32); store acc / l.
    """
    raise NotImplementedError("write me")


def paged_attention_split_k_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                   block_tables: torch.Tensor, context_lens: torch.Tensor,
                                   scale: Optional[float] = None, num_splits: int = 4, block_n: int = 16) -> torch.Tensor:
    """``paged_attention_triton`` with each context cut into num_splits slices ("flash decoding").

    Same arguments and result, plus num_splits >= 1. One program per (sequence, query head, split)
    runs the online softmax over its slice of the context (whole tiles of block_n; a slice may be
    empty) and stores its unnormalised state (m, l, acc) instead of an output. The launcher then
    merges the states of each (sequence, head) with the same rescaling as the online softmax:
    M = max of the m's, out = sum(exp(m - M) * acc) / sum(exp(m - M) * l).

    (Optional: the extension at the end of the chapter.) In the kernel, tl.program_id(2) is the
    split; slice s covers [s * span, min((s + 1) * span, context_len)) with
    span = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N. Store m, l, acc into float32
    buffers [num_seqs, num_heads, num_splits] (and [..., BLOCK_D]) and merge them in PyTorch.
    """
    raise NotImplementedError("write me")


def flash_prefill_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: Optional[float] = None,
                         block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    """Causal prefill attention by a Triton kernel (FlashAttention, forward): the engine's ``paged_prefill_attention``.

    q [total_new_tokens, num_heads, head_dim]: the new tokens of all sequences packed one after another,
    sequence s owning rows cu_seqlens_q[s] : cu_seqlens_q[s + 1] (cu_seqlens_q int32 [num_seqs + 1], from 0).
    k_pool, v_pool [num_blocks, block_size, num_kv_heads, head_dim] already hold the new tokens' K/V;
    block_tables int32 [num_seqs, max_blocks]; context_lens int32 [num_seqs] counts the cached prefix and the
    new chunk, so with q_len new tokens query i sits at absolute position context_len - q_len + i and sees
    positions 0 up to that (1 <= q_len <= context_len). GQA and scale as in ``paged_attention_triton``.
    One program per (tile of block_m queries, sequence, query head) walks the keys in tiles of block_n
    (powers of two, at least 16, as tl.dot wants) with the online softmax, and stops at the causal limit.
    Returns [total_new_tokens, num_heads, head_dim] in q's dtype.

    The question to answer before you write the loop: for a tile of queries, which is the last key
    position any of them may see, and which keys of a tile must still be masked, and why? Your decode
    kernel's walk and your online-softmax step carry over; what changes is that the state (m, l, acc)
    now has one row per query of the tile, and the scores of a tile are a [block_m, block_n] matrix.
    """
    raise NotImplementedError("write me")
