"""The paged KV cache: its layout, and the kernel that writes new tokens into it.

Why pages
---------
The contiguous cache of chapter 02 (``minfer/kv_cache.py``) reserves ``max_len`` slots for every
sequence up front. Most sequences stop long before, so most of that memory is reserved and never
used, and a batch can hold only as many sequences as their worst cases allow. The paged cache
borrows the operating system's answer to the same problem: cut the memory into fixed-size *blocks*
(pages) of ``block_size`` tokens, hand a sequence one block at a time as it grows, and keep a
*block table* per sequence that maps its logical token positions to physical blocks. Waste is at
most one partly filled block per sequence, and two sequences with the same prompt prefix can
point at the same blocks (prefix caching).

The layout
----------
Per layer there is one K pool and one V pool, each

    pool: [num_blocks, block_size, num_kv_heads, head_dim]

shared by every sequence in the batch. A sequence owns a list of block ids, its row of the block
table (``int32``). Rows are as wide as the longest sequence's list, so shorter ones are padded
past the blocks they own: the engine pads with block 0 (``minfer/engine/paged_kv.py``), the tests
with -1. The padding's value does not matter: every kernel masks the positions at and past a
sequence's length, so it never loads those table entries, let alone uses one as an address.

    block_tables:  [num_seqs, max_blocks_per_seq]   int32
    context_lens:  [num_seqs]                       int32, tokens stored for each sequence

Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``. Flattening (block, offset) gives the token's *slot*:

    slot = block * block_size + offset        pool.view(-1, num_kv_heads, head_dim)[slot]

Slots are how new tokens are addressed when they are written: the engine computes one slot per
new token (``slots_for_positions``) and passes the whole step's ``slot_mapping`` to ``write_kv``.
A slot of -1 means "no slot": padding tokens of a batch are skipped, not written.

int8 pools
----------
The pools may hold int8 instead of the model's dtype (``LLM(kv_cache_dtype="int8")``, see
``minfer/formats/kv.py``). Then each (token, KV head) vector also has a float32 scale, kept in a
scale pool beside each K and V pool, addressed by the same slots without the head_dim axis:

    scales: [num_blocks, block_size, num_kv_heads]   float32, value = int8 * scale

``write_kv`` quantizes as it stores, and ``load_kv_tile`` dequantizes right after it loads, so the
attention math in between is unchanged: it only ever sees ordinary K/V tiles.

fp8 pools
---------
Or ``torch.float8_e4m3fn`` (``LLM(kv_cache_dtype="fp8")``): then the scales are one float32 per KV
head for the whole layer, ``scales: [num_kv_heads]``, set once by calibration (``minfer/formats/kv.py``
says why per head, and why no per-token scale is needed). The kernels upcast each loaded tile to
float32 and multiply by its head's scale, a single number per program. Triton's interpreter runs
these conversions, so the tests check the kernels under ``TRITON_INTERPRET=1``, but it rounds
float32 to e4m3 wrongly in some cases, so ``write_kv`` rounds by hand first (``round_to_e4m3``).
A GPU converts e4m3 in hardware from sm_89 (Ada, Hopper) on (``tests/test_kernel_compile.py``
compiles the fp8 variants for sm_89 and sm_90, and says what sm_80 does); on an older GPU an fp8 pool
is refused with a ValueError (``minfer.formats.hardware``) before any kernel compiles.

Running the kernels
-------------------
Triton compiles for GPUs. On a CPU it can only *interpret* a kernel (numpy executes each program
instance), which is slow but exact, and that is how the tests check the kernels without a GPU.
The interpreter is chosen by the environment variable ``TRITON_INTERPRET=1``, read by
``@triton.jit`` when it decorates a function (triton's own ``tl.max``, ``tl.sum``... included), so it
must be set before triton is first imported.
Every wrapper here runs its Triton kernel on CUDA tensors or under the interpreter
(``use_triton``), and otherwise falls back to its PyTorch reference.

The interpreter is not a GPU: it accepts some kernels the GPU compiler rejects (a ``tl.dot`` whose
inner side is under 16), knows nothing of shared memory or registers, and computes float32
``tl.dot`` in float32 where a GPU would round to TF32 unless told ``input_precision="ieee"``
(which every kernel here says). ``tests/test_kernel_compile.py`` closes that gap without a GPU:
it compiles every kernel variant the engine launches to a cubin for sm_80 and sm_90 (its default launches
for sm_75, sm_86 and sm_89), with the
compiler and ``ptxas`` Triton ships, and checks their shared memory and registers
(``python benchmarks/kernel_resources.py`` prints them).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from minfer.formats.hardware import check_fp8_supported
from minfer.formats.kv import FP8_DTYPE, dequantize_kv, quantize_kv, quantize_kv_fp8


def use_triton(x: torch.Tensor) -> bool:
    """True where a Triton kernel can run on ``x``: a CUDA tensor, or anything under TRITON_INTERPRET=1."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def slots_for_positions(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots of tokens at ``positions``: block_table[p // block_size] * block_size + p % block_size.

    block_table: one sequence's row [max_blocks], or one row per position [len(positions), max_blocks]
    (a batch of sequences packed together, each token with its own sequence's row)."""
    positions = positions.long()
    rows = block_table.long().expand(len(positions), -1) if block_table.dim() == 1 else block_table.long()
    return rows.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size


def gather_blocks(pool: torch.Tensor, block_tables: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Copy whole blocks out of a pool, in table order: the one way the PyTorch paths read a paged cache.

    pool [num_blocks, block_size, num_kv_heads, *rest] (K/V: rest = [head_dim]; a scale pool: no
    rest), block_tables [num_seqs, width] -> [num_seqs, num_kv_heads, width * block_size, *rest].
    The blocks are selected along the pool's block axis with the heads first, so when the pool
    lies heads-first in memory (``KVPool``'s layout) every (head, sequence) row is one contiguous
    run of whole blocks, and the result is a view of one contiguous [num_kv_heads, num_seqs, ...]
    tensor (``out``, if given: reuse it, a fresh large allocation costs more than the copy).
    """
    num_seqs, width = block_tables.shape
    heads_first = pool.movedim(2, 0)  # [num_kv_heads, num_blocks, block_size, *rest]: a view
    picked = torch.index_select(heads_first, 1, block_tables.reshape(-1).long(), out=out)
    return picked.view(heads_first.shape[0], num_seqs, width * pool.shape[1], *pool.shape[3:]).transpose(0, 1)


def gather_kv(pool: torch.Tensor, block_table: torch.Tensor, length: int,
              scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One sequence's first ``length`` tokens of a pool, in order: [length, num_kv_heads, head_dim].

    The reference way to read a paged cache, for the kernels' references: copy the sequence's
    blocks out (``gather_blocks``), which is exactly what the kernels avoid. With ``scales`` (an
    int8 pool's scale pool, or an fp8 pool's per-head scales) the tokens come back dequantized, in float32.
    """
    table = block_table[None, :-(-length // pool.shape[1])]  # the blocks it fills (the rest may be padding)
    values = gather_blocks(pool, table)[0, :, :length].transpose(0, 1)
    if scales is None:
        return values
    if pool.dtype == FP8_DTYPE:
        return dequantize_kv(values, scales.expand(values.shape[:-1]))
    return dequantize_kv(values, gather_blocks(scales, table)[0, :, :length].transpose(0, 1))


def check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """The kernels address K and V with one set of strides and assume each head's vector is contiguous."""
    if k_pool.dim() != 4:
        raise ValueError(f"a KV pool is [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(k_pool.shape)}")
    if k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride() or k_pool.dtype != v_pool.dtype:
        raise ValueError("k_pool and v_pool must have the same shape, strides and dtype")
    if k_pool.stride(-1) != 1:
        raise ValueError("the last (head_dim) axis of the pools must be contiguous")


def check_scales(k_pool: torch.Tensor, k_scales: Optional[torch.Tensor], v_scales: Optional[torch.Tensor]) -> None:
    """int8 pools come with float32 scale pools [num_blocks, block_size, num_kv_heads], fp8 pools with
    float32 scales [num_kv_heads] (and a GPU from sm_89 on); other pools without."""
    if k_pool.dtype == FP8_DTYPE:
        check_fp8_supported(k_pool.device, "an fp8 KV pool")  # rather than Triton's refusal at compile time
        for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if scales is None or scales.shape != k_pool.shape[2:3] or scales.dtype != torch.float32 or not scales.is_contiguous():
                raise ValueError(f"fp8 pools need {name} float32 [{k_pool.shape[2]}] (one per KV head), got "
                                 f"{None if scales is None else (scales.dtype, tuple(scales.shape))}")
        return
    if k_pool.dtype != torch.int8:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"scales belong to int8 and fp8 pools; these pools are {k_pool.dtype}")
        return
    if k_scales is None or v_scales is None:
        raise ValueError("int8 pools need k_scales and v_scales (float32 [num_blocks, block_size, num_kv_heads])")
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales.shape != k_pool.shape[:3] or scales.dtype != torch.float32 or scales.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 {tuple(k_pool.shape[:3])} with a contiguous last axis, "
                             f"got {scales.dtype} {tuple(scales.shape)}")
    if k_scales.stride() != v_scales.stride():
        raise ValueError("k_scales and v_scales must have the same strides")


def check_tile(name: str, size: int) -> None:
    """Tile sizes feed tl.arange (powers of two only) and tl.dot (on a GPU, 16 along the inner side for
    16-bit operands; older Triton versions want 16 along every side)."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {size}")


def check_attention_inputs(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, k_scales: Optional[torch.Tensor] = None,
                           v_scales: Optional[torch.Tensor] = None) -> int:
    """Validate the shapes the attention kernels share; return the GQA group size (query heads per KV head)."""
    check_pools(k_pool, v_pool)
    check_scales(k_pool, k_scales, v_scales)
    num_heads, head_dim = q.shape[-2:]
    num_kv_heads = k_pool.shape[2]
    if q.dim() != 3 or head_dim != k_pool.shape[3] or num_heads % num_kv_heads:
        raise ValueError(f"q must be [tokens, num_heads, {k_pool.shape[3]}] with num_heads a multiple of "
                         f"num_kv_heads={num_kv_heads}, got {tuple(q.shape)}")
    if q.dtype != k_pool.dtype and k_pool.dtype not in (torch.int8, FP8_DTYPE):
        raise ValueError(f"q and the pools must share a dtype (or the pools be int8 or fp8), got {q.dtype} and {k_pool.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("the last (head_dim) axis of q must be contiguous")
    if (block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1
            or context_lens.shape != (block_tables.shape[0],)):
        raise ValueError(f"block_tables must be int32 [num_seqs, max_blocks] with contiguous rows and context_lens [num_seqs], "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    return num_heads // num_kv_heads

@triton.jit
def load_kv_tile(table_ptr, k_pool_ptr, v_pool_ptr, k_scale_ptr, v_scale_ptr, positions, token_ok, dims, dim_ok,
                 kv_head, stride_pool_block, stride_pool_token, stride_pool_head, stride_scale_block,
                 stride_scale_token, BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr, FP8: tl.constexpr):
    """K and V of one sequence's tokens at ``positions`` (one KV head), read through its block table.

    The page-table lookup every paged kernel shares: which block holds each position and where in
    it. Masked positions (``token_ok`` False) read no table entry and load zero K/V, so whatever
    pads a table row is never read.
    Returns two [len(positions), len(dims)] tiles. QUANTIZED (int8 pools): the tiles come back
    dequantized, in float32, each row times its token's scale. FP8 (fp8 pools): upcast to float32
    and times the KV head's one scale. Otherwise the scale arguments are unused (None) and the tiles
    keep the pools' dtype.
    """
    block = tl.load(table_ptr + positions // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
    # all in int64: block * stride_pool_block, and in a heads-first pool kv_head * stride_pool_head, pass 2**31 in big pools
    token = block * stride_pool_block + (positions % BLOCK_SIZE) * stride_pool_token + kv_head.to(tl.int64) * stride_pool_head
    offsets = token[:, None] + dims[None, :]
    mask = token_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_pool_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_pool_ptr + offsets, mask=mask, other=0.0)
    if QUANTIZED:  # one extra 4-byte load per token and head, then a multiply per element
        scale_offsets = block * stride_scale_block + (positions % BLOCK_SIZE) * stride_scale_token + kv_head
        k = k.to(tl.float32) * tl.load(k_scale_ptr + scale_offsets, mask=token_ok, other=0.0)[:, None]
        v = v.to(tl.float32) * tl.load(v_scale_ptr + scale_offsets, mask=token_ok, other=0.0)[:, None]
    if FP8:  # one scale per program: this KV head's
        k = k.to(tl.float32) * tl.load(k_scale_ptr + kv_head)
        v = v.to(tl.float32) * tl.load(v_scale_ptr + kv_head)
    return k, v


def write_kv_reference(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scales: Optional[torch.Tensor] = None,
                       v_scales: Optional[torch.Tensor] = None) -> None:
    """Store k_new, v_new [num_tokens, num_kv_heads, head_dim] at their slots, in place; slot -1 is skipped.

    int8 pools (with their scale pools): each (token, head) vector is quantized on the way in; fp8
    pools (with their per-head scales): divided by its head's scale and rounded to e4m3."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for pool, scales, new in ((k_pool, k_scales, k_new), (v_pool, v_scales, v_new)):
        if scales is None:
            pool.view(-1, *pool.shape[2:])[slots] = new[keep].to(pool.dtype)
        elif pool.dtype == FP8_DTYPE:
            pool.view(-1, *pool.shape[2:])[slots] = quantize_kv_fp8(new[keep], scales)
        else:
            values, scale = quantize_kv(new[keep])
            pool.view(-1, *pool.shape[2:])[slots] = values
            scales.view(-1, scales.shape[2])[slots] = scale


@triton.jit
def quantize_rows(x, scale_ptrs, row_ok):
    """int8 absmax quantization of each row of a [heads, dims] tile (masked lanes must be 0); stores the
    rows' float32 scales at ``scale_ptrs`` and returns the int8 tile. The same steps as ``quantize_kv``."""
    x = x.to(tl.float32)
    scale = tl.max(tl.abs(x), axis=1) / 127.0  # QMAX (a jitted function reads no plain Python globals)
    tl.store(scale_ptrs, scale, mask=row_ok)
    scaled = x / tl.where(scale == 0, 1.0, scale)[:, None]
    return (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int8)  # round half away from zero


@triton.jit
def round_to_e4m3(x):
    """float32 x (|x| <= 448) rounded to the nearest e4m3 number, ties to even, still in float32: the
    rounding ``tensor.to(torch.float8_e4m3fn)`` does. Done by hand because Triton's interpreter gets
    the cast wrong when rounding up crosses a power of two (127.9 becomes 64, not 128: it drops the
    carry into the exponent); after this the cast is exact, interpreted or on a GPU."""
    bits = x.to(tl.int32, bitcast=True)
    # below 2^-6 e4m3 is subnormal, multiples of 2^-9: 1.5 * 2^14 has a float32 ulp of 2^-9, so adding
    # it rounds |x| to a multiple (ties to even), and subtracting it leaves that multiple
    tiny = (tl.abs(x) + 24576.0) - 24576.0
    tiny = tl.where(bits < 0, -tiny, tiny)
    # normal numbers: keep 3 of float32's 23 mantissa bits, ties to even; a carry moves the exponent up
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    return tl.where(tl.abs(x) < 0.015625, tiny, bits.to(tl.float32, bitcast=True))


@triton.jit
def _write_kv_kernel(
    k_pool_ptr, v_pool_ptr, k_new_ptr, v_new_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_pool_block, stride_pool_token, stride_pool_head,
    stride_new_token, stride_new_head,
    stride_scale_block, stride_scale_token,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZED: tl.constexpr,
    FP8: tl.constexpr,
):
    # One program per new token: it copies that token's [num_kv_heads, head_dim] tile of K and of V.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: block * stride overflows int32 in big pools
    if slot < 0:  # a padding token writes nothing
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    # tl.arange needs a power of two, so the tile is padded and the padding masked off.
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    src = token * stride_new_token + heads[:, None] * stride_new_head + dims[None, :]
    dst = block * stride_pool_block + offset * stride_pool_token + heads[:, None].to(tl.int64) * stride_pool_head + dims[None, :]
    k = tl.load(k_new_ptr + src, mask=mask)
    v = tl.load(v_new_ptr + src, mask=mask)
    if QUANTIZED:  # int8 pools: one scale per head of this token, from this token's numbers alone
        scales = block * stride_scale_block + offset * stride_scale_token + heads
        k = quantize_rows(tl.where(mask, k, 0.0), k_scale_ptr + scales, heads < num_kv_heads)
        v = quantize_rows(tl.where(mask, v, 0.0), v_scale_ptr + scales, heads < num_kv_heads)
    if FP8:  # fp8 pools: each head's numbers over its scale, saturated at ±448 (FP8_MAX), then cast to e4m3
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)[:, None]
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)[:, None]
        k = round_to_e4m3(tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0))
        v = round_to_e4m3(tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0))
    tl.store(k_pool_ptr + dst, k.to(k_pool_ptr.dtype.element_ty), mask=mask)
    tl.store(v_pool_ptr + dst, v.to(v_pool_ptr.dtype.element_ty), mask=mask)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: Optional[torch.Tensor] = None,
             v_scales: Optional[torch.Tensor] = None) -> None:
    """Store k_new, v_new [num_tokens, num_kv_heads, head_dim] at their slots, in place; slot -1 is skipped.

    int8 pools need their scale pools (``k_scales``, ``v_scales``), fp8 pools their per-head scales;
    the new tokens are quantized.
    Runs the Triton kernel on CUDA tensors or under TRITON_INTERPRET=1, else ``write_kv_reference``.
    """
    check_pools(k_pool, v_pool)
    check_scales(k_pool, k_scales, v_scales)
    num_tokens, num_kv_heads, head_dim = k_new.shape
    # The kernel addresses both with k_new's strides; an axis of size 1 is never stepped along, and
    # its stride is arbitrary (one decode token's K and V differ there), so it need not match.
    same_strides = all(a == b or n == 1 for a, b, n in zip(k_new.stride(), v_new.stride(), k_new.shape))
    if k_new.shape != v_new.shape or not same_strides or (num_kv_heads, head_dim) != tuple(k_pool.shape[2:]):
        raise ValueError(f"k_new and v_new must both be [num_tokens, {k_pool.shape[2]}, {k_pool.shape[3]}] with the same strides, "
                         f"got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must hold one slot per new token ({num_tokens}), got shape {tuple(slot_mapping.shape)}")
    if not use_triton(k_pool):
        write_kv_reference(k_pool, v_pool, k_new, v_new, slot_mapping, k_scales, v_scales)
        return
    if num_tokens == 0:
        return
    if k_new.stride(-1) != 1:
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    quantized, fp8 = k_pool.dtype == torch.int8, k_pool.dtype == FP8_DTYPE
    _write_kv_kernel[(num_tokens,)](
        k_pool, v_pool, k_new, v_new, slot_mapping, k_scales, v_scales,
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        k_new.stride(0), k_new.stride(1),
        k_scales.stride(0) if quantized else 0, k_scales.stride(1) if quantized else 0,
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_pool.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZED=quantized, FP8=fp8,
    )
