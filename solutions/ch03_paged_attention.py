"""Chapter 03, worked: paged attention, from block tables to the kernel's online softmax."""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from minfer.kernels.paged_cache import check_attention_inputs, check_tile
from minfer.kernels.paged_prefill_attention import check_cu_seqlens


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
    1/sqrt(head_dim). Returns softmax(q·k * scale) @ v over the context_len tokens, [num_heads, head_dim],
    in q's dtype (compute in float32).
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
    of all n scores at once (no torch.softmax). Returns [head_dim] in q's dtype (compute in float32).
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


# ----------------------------------------------------------------- the Triton ladder
# Three kernels, each one step closer to minfer/kernels/paged_decode_attention.py, then a fourth, the
# prefill kernel of minfer/kernels/paged_prefill_attention.py in its simplest form. On a CPU they run
# under Triton's interpreter (TRITON_INTERPRET=1, set before triton is first imported).

@triton.jit
def _softmax_rows_kernel(x_ptr, out_ptr, n_cols, stride_x_row, stride_out_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # BLOCK is n_cols rounded up to a power of two: the lanes past n_cols are masked
    col_ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=col_ok, other=float("-inf"))
    e = tl.exp(x - tl.max(x, axis=0))  # the padding lanes hold -inf, so they add exp(-inf) = 0 to the sum
    tl.store(out_ptr + row * stride_out_row + cols, e / tl.sum(e, axis=0), mask=col_ok)


def softmax_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, dim=1) of a 2-D float32 tensor, computed by a Triton kernel with one program per row.

    x [rows, cols] (cols >= 1), its rows contiguous (x.stride(1) == 1) but possibly spaced apart
    (any x.stride(0)). Each program loads its whole row (padded to a power of two, the padding
    masked off), subtracts the row's maximum, and divides the exponentials by their sum. Returns a
    new [rows, cols] tensor.
    """
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] < 1 or x.stride(1) != 1:
        raise ValueError(f"x must be a 2-D float32 tensor with at least one column and contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)} with strides {x.stride()}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _softmax_rows_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0),
                                        BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@triton.jit
def online_softmax_step(m, l, acc, scores, v):
    """Fold one tile of keys into one query row's running state; return the new ``(m, l, acc)``.

    m, l: scalars (running maximum, running sum of exp(score - m)); acc [D] (running sum of
    exp(score - m) * v); scores [N], -inf for a key that must not count; v [N, D], finite everywhere.
    (The engine's ``online_softmax_update`` is the same step for a tile of rows at once, with tl.dot.)
    """
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    alpha = tl.exp(m - m_new)  # corrects what was summed against the old maximum; 0 when m was -inf
    p = tl.exp(scores - m_new)
    return m_new, l * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * v, axis=0)


@triton.jit
def _online_softmax_tile_kernel(m_ptr, l_ptr, acc_ptr, scores_ptr, v_ptr, m_out_ptr, l_out_ptr, acc_out_ptr,
                                n_keys, head_dim, stride_acc_row, stride_scores_row, stride_v_key, stride_acc_out_row,
                                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    keys = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    key_ok = keys < n_keys
    dim_ok = dims < head_dim
    m = tl.load(m_ptr + row)
    l = tl.load(l_ptr + row)
    acc = tl.load(acc_ptr + row * stride_acc_row + dims, mask=dim_ok, other=0.0)
    scores = tl.load(scores_ptr + row * stride_scores_row + keys, mask=key_ok, other=float("-inf"))
    v = tl.load(v_ptr + keys[:, None] * stride_v_key + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                other=0.0)
    m, l, acc = online_softmax_step(m, l, acc, scores, v)
    tl.store(m_out_ptr + row, m)
    tl.store(l_out_ptr + row, l)
    tl.store(acc_out_ptr + row * stride_acc_out_row + dims, acc, mask=dim_ok)


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
    """
    rows, n_keys = scores.shape if scores.dim() == 2 else (-1, -1)
    head_dim = v.shape[-1]
    shapes_ok = m.shape == l.shape == (rows,) and acc.shape == (rows, head_dim) and v.shape == (n_keys, head_dim)
    layouts_ok = all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in (m, l, acc, scores, v))
    if not shapes_ok or not layouts_ok or n_keys < 1:
        raise ValueError("expected float32 m, l [rows], acc [rows, D], scores [rows, N >= 1], v [N, D] with contiguous "
                         f"rows, got m {tuple(m.shape)}, l {tuple(l.shape)}, acc {tuple(acc.shape)}, "
                         f"scores {tuple(scores.shape)}, v {tuple(v.shape)}")
    m_out, l_out = torch.empty_like(m), torch.empty_like(l)
    acc_out = torch.empty(acc.shape, dtype=acc.dtype, device=acc.device)
    _online_softmax_tile_kernel[(rows,)](m, l, acc, scores, v, m_out, l_out, acc_out, n_keys, head_dim,
                                         acc.stride(0), scores.stride(0), v.stride(0), acc_out.stride(0),
                                         BLOCK_N=triton.next_power_of_2(n_keys),
                                         BLOCK_D=triton.next_power_of_2(head_dim))
    return m_out, l_out, acc_out


@triton.jit
def _paged_attention_kernel(q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, context_lens_ptr, out_ptr, scale,
                            stride_q_seq, stride_q_head, stride_pool_block, stride_pool_token, stride_pool_head,
                            stride_table_seq, stride_out_seq, stride_out_head, head_dim,
                            GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + dims, mask=dim_ok, other=0.0).to(tl.float32)

    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for start in range(0, context_len, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        token_ok = positions < context_len
        # slot_for, for a whole tile: which block holds each position, and where in that block
        block = tl.load(table + positions // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
        token = block * stride_pool_block + (positions % BLOCK_SIZE) * stride_pool_token + kv_head * stride_pool_head
        mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_pool_ptr + token[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_pool_ptr + token[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        scores = tl.where(token_ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m, l, acc = online_softmax_step(m, l, acc, scores, v)  # the first tile holds position 0: m turns finite

    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims, (acc / l).to(out_ptr.dtype.element_ty),
             mask=dim_ok)


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
    """
    group = check_attention_inputs(q, k_pool, v_pool, block_tables, context_lens)
    if block_n < 1 or block_n & (block_n - 1):  # tl.arange wants a power of two; no tl.dot here, so no minimum
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    num_seqs, num_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    _paged_attention_kernel[(num_seqs, num_heads)](
        q, k_pool, v_pool, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), head_dim,
        GROUP=group, BLOCK_SIZE=k_pool.shape[1], BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim))
    return out


@triton.jit
def _paged_attention_split_kernel(q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, context_lens_ptr,
                                  m_ptr, l_ptr, acc_ptr, scale,
                                  stride_q_seq, stride_q_head, stride_pool_block, stride_pool_token, stride_pool_head,
                                  stride_table_seq, head_dim,
                                  GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)
    # This program's share of the context: whole tiles, so that only the sequence's last tile is partial.
    span = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    first = split * span
    last = tl.minimum(first + span, context_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + dims, mask=dim_ok, other=0.0).to(tl.float32)

    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for start in range(first, last, BLOCK_N):  # the same loop as _paged_attention_kernel, over [first, last)
        positions = start + tl.arange(0, BLOCK_N)
        token_ok = positions < last
        block = tl.load(table + positions // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
        token = block * stride_pool_block + (positions % BLOCK_SIZE) * stride_pool_token + kv_head * stride_pool_head
        mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_pool_ptr + token[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_pool_ptr + token[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        scores = tl.where(token_ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m, l, acc = online_softmax_step(m, l, acc, scores, v)

    # Unnormalised partial state; a split past the context stores the empty state (-inf, 0, 0).
    state = (seq * tl.num_programs(1) + head) * NUM_SPLITS + split
    tl.store(m_ptr + state, m)
    tl.store(l_ptr + state, l)
    tl.store(acc_ptr + state * BLOCK_D + dims, acc)


def paged_attention_split_k_triton(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                   block_tables: torch.Tensor, context_lens: torch.Tensor,
                                   scale: Optional[float] = None, num_splits: int = 4, block_n: int = 16) -> torch.Tensor:
    """``paged_attention_triton`` with each context cut into num_splits slices ("flash decoding").

    Same arguments and result, plus num_splits >= 1. One program per (sequence, query head, split)
    runs the online softmax over its slice of the context (whole tiles of block_n; a slice may be
    empty) and stores its unnormalised state (m, l, acc) instead of an output. The launcher then
    merges the states of each (sequence, head) with the same rescaling as the online softmax:
    M = max of the m's, out = sum(exp(m - M) * acc) / sum(exp(m - M) * l).
    """
    group = check_attention_inputs(q, k_pool, v_pool, block_tables, context_lens)
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    num_seqs, num_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    block_d = triton.next_power_of_2(head_dim)
    m = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    _paged_attention_split_kernel[(num_seqs, num_heads, num_splits)](
        q, k_pool, v_pool, block_tables, context_lens, m, l, acc, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0), head_dim,
        GROUP=group, BLOCK_SIZE=k_pool.shape[1], NUM_SPLITS=num_splits, BLOCK_N=block_n, BLOCK_D=block_d)
    weight = torch.exp(m - m.max(dim=-1, keepdim=True).values)  # empty splits weigh exp(-inf) = 0
    out = (weight[..., None] * acc).sum(dim=2) / (weight * l).sum(dim=2, keepdim=True)
    return out[..., :head_dim].to(q.dtype)


# ----------------------------------------------------------------- 7e: FlashAttention for prefill

@triton.jit
def _flash_prefill_kernel(q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
                          scale, stride_q_token, stride_q_head, stride_pool_block, stride_pool_token, stride_pool_head,
                          stride_table_seq, stride_out_token, stride_out_head, head_dim,
                          GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # this tile's queries, counted within the sequence's chunk
    row_ok = rows < q_len  # the grid is sized for the longest chunk: a shorter one leaves rows (or whole tiles) idle
    query_pos = context_len - q_len + rows  # each query's absolute position: the cached prefix comes first
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                mask=q_mask, other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causality: no query of this tile sees past the position of its last query, so the walk stops there.
    kv_end = tl.minimum(context_len - q_len + (tile + 1) * BLOCK_M, context_len)
    table = block_tables_ptr + seq * stride_table_seq
    for start in range(0, kv_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        token_ok = positions < kv_end
        block = tl.load(table + positions // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
        token = block * stride_pool_block + (positions % BLOCK_SIZE) * stride_pool_token + kv_head * stride_pool_head
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_pool_ptr + token[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_pool_ptr + token[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        # a [BLOCK_M, BLOCK_N] tile of scores: one matrix product, the work that makes prefill compute-bound
        # (input_precision="ieee": float32 stays float32 on a GPU, whose default rounds it to TF32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = token_ok[None, :] & (positions[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # online_softmax_step, for BLOCK_M rows at once. Every row sees position 0 in the first tile (an idle
        # row past q_len sits beyond the context and sees all of it), so m turns finite there.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    out = acc / l[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


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
    """
    group = check_attention_inputs(q, k_pool, v_pool, block_tables, context_lens)
    check_tile("block_m", block_m)
    check_tile("block_n", block_n)
    q_lens = check_cu_seqlens(q, cu_seqlens_q, context_lens)
    num_heads, head_dim = q.shape[1:]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    grid = (triton.cdiv(max(q_lens), block_m), len(q_lens), num_heads)
    _flash_prefill_kernel[grid](
        q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens, out, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), head_dim,
        GROUP=group, BLOCK_SIZE=k_pool.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    return out
