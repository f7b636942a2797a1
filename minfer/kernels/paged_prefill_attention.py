"""Paged prefill attention: a chunk of new tokens per sequence, flash-attention tiles over paged K/V.

The problem
-----------
Prefill brings many new tokens per sequence: a whole prompt, or (with chunked prefill and prefix
caching) the next chunk of a prompt whose beginning is already in the cache. The batch's new
tokens are packed one after another, with no padding:

    q:             [total_new_tokens, num_heads, head_dim]
    cu_seqlens_q:  [num_seqs + 1]   sequence s owns rows cu_seqlens_q[s] : cu_seqlens_q[s + 1]

Their K and V have already been written into the pools (``paged_cache.write_kv``), so each
sequence's ``context_len`` visible tokens, the cached prefix followed by the new chunk, are all
read through its block table. With ``q_len`` new tokens, query i of a sequence is the token at
absolute position ``context_len - q_len + i``, and causality lets it see positions 0 up to that.

The reference
-------------
``paged_prefill_attention_reference`` gathers each sequence's K/V, builds the
[num_heads, q_len, context_len] score matrix, masks the future, and applies softmax.
That matrix grows with q_len x context_len: for a 32k-token prompt, 4 GiB per head in float32.

The kernel
----------
Flash attention: one program per (tile of ``BLOCK_M`` queries, sequence, query head). It loads
its query tile once, then walks the keys in tiles of ``BLOCK_N``, gathered through the block
table exactly as in the decode kernel, keeping the online-softmax state (running max ``m``,
running sum ``l``, running output ``acc``) per query row and updating it with the decode kernel's
step (``online_softmax.py``). Only a [BLOCK_M, BLOCK_N] block of scores exists at any time.
Two consequences of causality save work:

* the key loop stops after the position of the tile's last query: later keys are invisible to
  every row of the tile;
* a program whose query tile starts past its sequence's q_len (the grid is sized for the longest
  sequence) returns at once.

Unlike decode, prefill does O(q_len) math per K/V byte, so it is bound by compute, not by memory:
one program per query head, re-reading the K/V tile its group shares, costs little here.
Tiles wholly below the diagonal need no mask; splitting the loop to skip it is a further step.

int8 pools and fp8 pools (with ``k_scales``/``v_scales``) are read as in the decode kernel: each tile is
dequantized by ``load_kv_tile`` right after loading.

Inputs must satisfy ``1 <= q_len <= context_len`` for every sequence.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from minfer.kernels.online_softmax import online_softmax_update
from minfer.kernels.paged_cache import check_attention_inputs, check_tile, gather_kv, load_kv_tile, use_triton


def check_cu_seqlens(q: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor) -> list[int]:
    """Return the query lengths, after checking they tile q and fit in their contexts."""
    starts = cu_seqlens_q.tolist()
    q_lens = [end - start for start, end in zip(starts, starts[1:])]
    if len(starts) != len(context_lens) + 1 or starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must be [num_seqs + 1] cumulative starts from 0 to {q.shape[0]}, got {starts}")
    if any(not 1 <= q_len <= ctx for q_len, ctx in zip(q_lens, context_lens.tolist())):
        raise ValueError(f"every sequence needs 1 <= q_len <= context_len, got q_lens {q_lens} "
                         f"and context_lens {context_lens.tolist()}")
    return q_lens


def paged_prefill_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                      context_lens: torch.Tensor, scale: Optional[float] = None, *,
                                      k_scales: Optional[torch.Tensor] = None,
                                      v_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged K/V, by gathering and masked softmax.

    q [total_new_tokens, num_heads, head_dim], packed by cu_seqlens_q [num_seqs + 1];
    k_pool, v_pool [num_blocks, block_size, num_kv_heads, head_dim], already holding the new tokens;
    block_tables int32 [num_seqs, max_blocks]; context_lens [num_seqs] counts the new tokens too;
    scale defaults to 1/sqrt(head_dim). Returns [total_new_tokens, num_heads, head_dim] in q's dtype;
    the math runs in float32. int8 pools come with k_scales, v_scales [num_blocks, block_size, num_kv_heads],
    fp8 pools with k_scales, v_scales [num_kv_heads].
    """
    group = check_attention_inputs(q, k_pool, v_pool, block_tables, context_lens, k_scales, v_scales)
    q_lens = check_cu_seqlens(q, cu_seqlens_q, context_lens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    for seq, (start, q_len, ctx) in enumerate(zip(cu_seqlens_q.tolist(), q_lens, context_lens.tolist())):
        k = gather_kv(k_pool, block_tables[seq], ctx, k_scales).repeat_interleave(group, dim=1).float()  # [ctx, heads, dim]
        v = gather_kv(v_pool, block_tables[seq], ctx, v_scales).repeat_interleave(group, dim=1).float()
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len].float(), k) * scale
        query_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        visible = torch.arange(ctx, device=q.device)[None, :] <= query_pos[:, None]  # [q_len, ctx]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,  # int8 pools: their scale pools; fp8 pools: per-head scales (None otherwise)
    scale,
    stride_q_token, stride_q_head,
    stride_pool_block, stride_pool_token, stride_pool_head,
    stride_scale_block, stride_scale_token,
    stride_table_seq,
    stride_out_token, stride_out_head,
    head_dim,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid is sized for the longest sequence; this one is shorter
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)   # query index within the sequence's chunk
    row_ok = rows < q_len
    query_pos = context_len - q_len + rows          # absolute position of each query token
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q_offsets = (q_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Causality: no query of this tile sees past the last valid row's position.
    kv_end = context_len - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len)
    table = block_tables_ptr + seq * stride_table_seq
    for start in range(0, kv_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        token_ok = positions < kv_end
        k, v = load_kv_tile(table, k_pool_ptr, v_pool_ptr, k_scale_ptr, v_scale_ptr, positions, token_ok, dims,
                            dim_ok, kv_head, stride_pool_block, stride_pool_token, stride_pool_head,
                            stride_scale_block, stride_scale_token, BLOCK_SIZE, QUANTIZED, FP8)
        if QUANTIZED or FP8:  # the dequantized tiles are float32; tl.dot wants both operands in q's dtype
            k, v = k.to(q.dtype), v.to(q.dtype)  # [BLOCK_N, BLOCK_D]

        # input_precision="ieee": float32 stays float32 on a GPU (the default rounds it to TF32).
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N], float32
        visible = token_ok[None, :] & (positions[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees position 0 in the first tile (padding rows past q_len sit beyond the
        # context and see all of it), so every row has a finite score, as the update requires.
        m, l, acc = online_softmax_update(m, l, acc, scores, v)

    out = acc / l[:, None]
    out_offsets = (q_start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_tiles(dtype: torch.dtype) -> dict:
    """The tile (``BLOCK_M`` queries x ``BLOCK_N`` keys) and the warps per program, for queries of ``dtype``.

    bfloat16/float16: 64 x 32 over 4 warps, on tensor cores (64 x 64 spills a few registers on
    sm_80 with head_dim 128 or int8 KV). float32: exact products (input_precision="ieee") run on
    the CUDA cores and hold far more in registers: 64 x 64 spills kilobytes and takes tens of
    seconds to compile, so float32 takes 16 x 16 over 8 warps, which spills in no variant.
    ``benchmarks/kernel_resources.py`` shows each variant's registers and shared memory.
    """
    if dtype == torch.float32:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 8}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            scale: Optional[float] = None, *, block_m: Optional[int] = None,
                            block_n: Optional[int] = None, k_scales: Optional[torch.Tensor] = None,
                            v_scales: Optional[torch.Tensor] = None, max_q_len: Optional[int] = None) -> torch.Tensor:
    """The Triton kernel for ``paged_prefill_attention_reference`` (same arguments, same result).

    ``block_m`` queries and ``block_n`` keys make one tile (powers of two, at least 16; default:
    ``prefill_tiles``): tuning knobs, independent of the pools' block size. Runs the Triton kernel
    on CUDA tensors or under TRITON_INTERPRET=1; elsewhere falls back to the reference.
    ``max_q_len``: the longest chunk, from a caller that knows it on the host (the engine): then
    cu_seqlens_q is trusted as given, and the kernel launches without waiting for the GPU.
    """
    group = check_attention_inputs(q, k_pool, v_pool, block_tables, context_lens, k_scales, v_scales)
    tiles = prefill_tiles(q.dtype)
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size is not None:
            check_tile(name, size)
            tiles[name.upper()] = size
    if not use_triton(q):
        return paged_prefill_attention_reference(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens, scale,
                                                 k_scales=k_scales, v_scales=v_scales)
    if max_q_len is None:  # sizing the grid needs the longest chunk on the host: read it (a sync), checked
        max_q_len = max(check_cu_seqlens(q, cu_seqlens_q, context_lens))
    num_heads, head_dim = q.shape[1:]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_q_len, tiles["BLOCK_M"]), len(context_lens), num_heads)
    quantized, fp8 = k_pool.dtype == torch.int8, k_pool.dtype == torch.float8_e4m3fn
    _paged_prefill_kernel[grid](
        q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens, out,
        k_scales, v_scales,
        scale,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        k_scales.stride(0) if quantized else 0, k_scales.stride(1) if quantized else 0,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        head_dim,
        GROUP=group, BLOCK_SIZE=k_pool.shape[1], QUANTIZED=quantized, FP8=fp8,
        BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"], BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=tiles["num_warps"],
    )
    return out
