"""Paged decode attention: one new query token per sequence, reading K/V through the block table.

The problem
-----------
In a decode step every sequence of the batch brings one new token. Its query must attend over
all ``context_len`` keys and values the sequence has stored, and those sit in the paged pools
(see ``paged_cache.py``), scattered over whatever blocks the sequence was given. The work per
byte is tiny (one multiply-add per K or V element read, per query head), so the step is bound by
memory bandwidth: a good decode kernel is one that reads every K/V byte once, at full speed, and
does nothing else.

The reference
-------------
``paged_decode_attention_reference`` does the obvious thing: gather the sequence's K and V into
contiguous tensors, repeat them for the grouped query heads, and apply softmax(q k^T * scale) v.
It copies the whole context (twice, with the GQA repeat) before any math happens.

The kernel
----------
One program per (sequence, KV head). It walks the sequence's tokens in tiles of ``BLOCK_N``:

1. *Gather through the block table.* For the tile's positions ``p`` it loads
   ``block_table[p // block_size]`` and addresses token ``p`` at (that block, ``p % block_size``).
   A tile may cover part of a block or several blocks: the tile size is a tuning choice, the block
   size a memory-management choice, and neither constrains the other.
2. *Serve the whole query group with one read.* With grouped-query attention, ``group`` query
   heads share each KV head (query head h reads KV head h // group). The program holds all of
   them as the rows of a [group, head_dim] query tile, so each K/V tile is loaded once and used
   ``group`` times: the bandwidth saving GQA promises, which a kernel with one program per query
   head would give away. The group is padded to ``BLOCK_G`` = 16 rows, the height of a
   tensor-core tile (older Triton versions refuse a smaller ``tl.dot``; newer ones pad it
   themselves), and the padding masked off; the wasted multiply-adds are free in a memory-bound
   kernel.
3. *Online softmax* (``online_softmax.py``). The program never holds a full row of scores. It
   keeps, per query head, the running maximum ``m``, the running sum ``l`` of exp(score - m), and
   the running output ``acc`` = sum of exp(score - m) * v. When a tile raises the maximum from
   ``m`` to ``m'``, everything accumulated so far was scaled by exp(-m) instead of exp(-m'), so it
   is rescaled by ``alpha = exp(m - m')`` before the tile is added (``online_softmax_update``, the
   step the prefill kernel shares). At the end ``acc / l`` is exactly softmax(scores) @ V: the
   same numbers as the reference, computed in one pass.

What comes next (not done here): when a batch has few sequences but long contexts, one program
per (sequence, KV head) leaves most of a GPU idle; *split-K* ("flash decoding") gives several
programs a slice of the context each and merges their (m, l, acc) with the same rescaling.

int8 pools: pass their scale pools as ``k_scales``/``v_scales`` and each K/V tile is dequantized
right after it is loaded (``load_kv_tile``); the rest of the kernel runs as before. It still reads
every byte once, but now half as many bytes as bfloat16 (plus 4 per 64-value scale row).
fp8 pools (``torch.float8_e4m3fn``) come with one scale per KV head (``k_scales``/``v_scales``
[num_kv_heads]): each tile is upcast and multiplied by the program's one scale, and the bytes read
are exactly half of bfloat16's. Triton's interpreter upcasts e4m3 exactly, so the tests check this
path under ``TRITON_INTERPRET=1`` like the others; compiled, it needs sm_89+ (``paged_cache.py``).

Inputs must satisfy ``context_lens >= 1``: a sequence with nothing stored has nothing to attend to.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from minfer.kernels.online_softmax import online_softmax_update
from minfer.kernels.paged_cache import check_attention_inputs, check_tile, gather_kv, load_kv_tile, use_triton


def paged_decode_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                                     scale: Optional[float] = None, *, k_scales: Optional[torch.Tensor] = None,
                                     v_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one query per sequence over its paged K/V, by gathering and softmax.

    q [num_seqs, num_heads, head_dim]; k_pool, v_pool [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables int32 [num_seqs, max_blocks]; context_lens [num_seqs] (each >= 1); scale defaults to
    1/sqrt(head_dim). Returns [num_seqs, num_heads, head_dim] in q's dtype; the math runs in float32.
    int8 pools come with k_scales, v_scales [num_blocks, block_size, num_kv_heads] (float32), fp8
    pools with k_scales, v_scales [num_kv_heads] (float32).
    """
    group = check_attention_inputs(q, k_pool, v_pool, block_tables, context_lens, k_scales, v_scales)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    for seq, length in enumerate(context_lens.tolist()):
        k = gather_kv(k_pool, block_tables[seq], length, k_scales).repeat_interleave(group, dim=1).float()  # [len, heads, dim]
        v = gather_kv(v_pool, block_tables[seq], length, v_scales).repeat_interleave(group, dim=1).float()
        scores = torch.einsum("hd,nhd->hn", q[seq].float(), k) * scale
        out[seq] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,  # int8 pools: their scale pools; fp8 pools: per-head scales (None otherwise)
    scale,
    stride_q_seq, stride_q_head,
    stride_pool_block, stride_pool_token, stride_pool_head,
    stride_scale_block, stride_scale_token,
    stride_table_seq,
    stride_out_seq, stride_out_head,
    head_dim,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr, FP8: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    # The query tile: the GROUP query heads that read this KV head, one per row (padded to BLOCK_G).
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # running max of the scores, per query head
    l = tl.zeros([BLOCK_G], dtype=tl.float32)                 # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)      # running sum of exp(score - m) * v

    table = block_tables_ptr + seq * stride_table_seq
    for start in range(0, context_len, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        token_ok = positions < context_len
        # Page-table lookup: the K/V of these positions wherever their blocks are ([BLOCK_N, BLOCK_D]).
        k, v = load_kv_tile(table, k_pool_ptr, v_pool_ptr, k_scale_ptr, v_scale_ptr, positions, token_ok, dims,
                            dim_ok, kv_head, stride_pool_block, stride_pool_token, stride_pool_head,
                            stride_scale_block, stride_scale_token, BLOCK_SIZE, QUANTIZED, FP8)
        if QUANTIZED or FP8:  # the dequantized tiles are float32; tl.dot wants both operands in q's dtype
            k, v = k.to(q.dtype), v.to(q.dtype)

        # input_precision="ieee": float32 stays float32 on a GPU (the default rounds it to TF32).
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_G, BLOCK_N], float32
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        # The first tile holds position 0, so every row has a finite score, as the update requires.
        m, l, acc = online_softmax_update(m, l, acc, scores, v)

    out = acc / l[:, None]
    tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def decode_tiles(dtype: torch.dtype) -> dict:
    """The tile of keys per loop step (``BLOCK_N``) and the warps per program, for queries of ``dtype``.

    bfloat16/float16: 64 keys over 4 warps; ``tl.dot`` runs on tensor cores. float32: the kernel
    asks for exact float32 products (input_precision="ieee"), which ``tl.dot`` computes on the
    CUDA cores with far more of each operand held in registers; with 64 keys per step the
    int8-KV and head_dim-128 variants spill registers, so float32 takes 16 keys over 8 warps.
    ``benchmarks/kernel_resources.py`` shows each variant's registers and shared memory.
    """
    return {"BLOCK_N": 16, "num_warps": 8} if dtype == torch.float32 else {"BLOCK_N": 64, "num_warps": 4}


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: Optional[float] = None, *, block_n: Optional[int] = None,
                           k_scales: Optional[torch.Tensor] = None, v_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Triton kernel for ``paged_decode_attention_reference`` (same arguments, same result).

    ``block_n`` is the number of tokens a program processes per step of its loop (a power of two,
    at least 16; default: ``decode_tiles``): a tuning knob, independent of the pools' block size.
    Runs the Triton kernel on CUDA tensors or under TRITON_INTERPRET=1; elsewhere falls back to
    the reference.
    """
    group = check_attention_inputs(q, k_pool, v_pool, block_tables, context_lens, k_scales, v_scales)
    tiles = decode_tiles(q.dtype)
    if block_n is not None:
        check_tile("block_n", block_n)
        tiles["BLOCK_N"] = block_n
    if not use_triton(q):
        return paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale,
                                                k_scales=k_scales, v_scales=v_scales)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    quantized, fp8 = k_pool.dtype == torch.int8, k_pool.dtype == torch.float8_e4m3fn
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_pool, v_pool, block_tables, context_lens, out,
        k_scales, v_scales,
        scale,
        q.stride(0), q.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        k_scales.stride(0) if quantized else 0, k_scales.stride(1) if quantized else 0,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        head_dim,
        GROUP=group, BLOCK_SIZE=k_pool.shape[1], QUANTIZED=quantized, FP8=fp8,
        # tl.arange wants powers of two; on a GPU tl.dot wants its inner side (BLOCK_D, BLOCK_N)
        # >= 16 for 16-bit operands, and older Triton versions 16 rows too (BLOCK_G).
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles["BLOCK_N"],
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=tiles["num_warps"],
    )
    return out
