"""Weight-only quantized matmuls: dequantize inside the kernel, never in memory.

The problem
-----------
A decode step multiplies a handful of activation rows ``x [M, K]`` (M = the batch, often 1..32) by
every weight matrix ``W [N, K]`` of the model. Each weight is used M times per step, so for small M
the step's time is the time to *read* the weights: it is memory-bound. Storing W as int8 (1 byte
per weight) or packed int4 (half a byte plus a scale and a minimum per group) reads 2x or ~3.6x
fewer bytes than bfloat16, and that is the whole speed-up weight-only quantization can give.

The reference
-------------
``int8_matmul_reference`` and ``int4_matmul_reference`` do the obvious thing: rebuild the float
matrix (``minfer.formats.weights.dequantize_*``), then ``x @ W.T``. Correct, but it writes a full
float copy of W and reads it back: more memory traffic than the unquantized model, not less.

The kernels
-----------
One program per ``[BLOCK_M, BLOCK_N]`` tile of the output. It walks K in steps of ``BLOCK_K``,
loads the activation tile and the *quantized* weight tile, turns the weight tile into floats in
registers, and accumulates ``tl.dot(x, w.T)`` in float32. The float weights exist only in
registers, one tile at a time; memory is read in the small format.

- int8: the scale is per output channel (per row of W), so it factors out of the sum over K:
  ``sum_k x[m,k] * q[n,k] * s[n] = s[n] * sum_k x[m,k] * q[n,k]``. The loop multiplies by the bare
  integers and each output is scaled once at the end.
- int4: the scale and minimum change every ``group_size`` columns, so they cannot be factored out;
  ``BLOCK_K`` divides the group size, so each K step lies inside one group and needs one scale and one
  minimum per row: ``w = q * scale + min``. The packed bytes are loaded as int32 words, 8 codes each,
  and for 16-bit activations turned into floats without an int-to-float conversion: a code ORed into
  the mantissa of 1024.0 (float16) or 128.0 (bfloat16) makes that float plus the code, two codes per
  32-bit operation (``_codes_as_floats``). For float16, subtracting the constant is exact and
  ``q * scale + min`` is one fused multiply-add, two weights per instruction (HFMA2), rounded once: the
  reference's float32 weight rounded to float16. bfloat16 would round the float16 scale and minimum to
  its 8 bits first (a few times the error of rounding the weight, measured on the outputs), so there
  the multiply-add runs in float32 with the constant folded into the offset, ``(128 + q) * scale +
  (min - 128 * scale)`` (exact enough: float32 carries 16 bits more than the bfloat16 result), and the
  result is rounded to bfloat16: one FFMA per weight and a conversion per two.
  Float32 activations keep a shift, a mask and a conversion per weight: their products run on the
  CUDA cores, 16 multiply-adds per weight, which the conversion does not change much.

Tiles: a decode step has one row, so the grid is one program per ``BLOCK_N`` outputs, and narrow tiles
are what put many SMs to work. ``benchmarks/tune_quant_matmul.py`` times every choice on an H200
(docs/benchmarks.md): for Llama-3.1-8B's 4096 x 14336 down projection, tiles of 64 outputs with
K steps of 64 or 32 take 111 us in int8 and 772 us in int4, against 42 us for dense bfloat16; 32
outputs and K steps of 256 bring int8 to 41 us (as fast as dense, from half the bytes), 16 outputs and
K steps of 64 bring int4 to 245 us. (Those are for bfloat16 activations; float32 ones keep the shorter
K steps, which their exact products need to fit in registers.) The int4 times were measured with a
shift, a mask, a conversion and a multiply-add per weight: 22.75 machine instructions per weight in
the compiled K loop (sm_90, bfloat16). The conversion-free loop described above takes 14.00
(``benchmarks/sass_inner_loop.py``, docs/kernels.md); timing it is ``tune_quant_matmul.py``'s job on
a GPU.

Split-K: cutting K into ``num_splits`` slices (a third grid axis) gives still more programs: each sums
its slice into a float32 partial, and a ``sum`` over the slices finishes the job, at the price of that
sum (and a cast) as two more launches. ``num_splits=None`` lets ``num_k_splits`` choose (toward two
programs per SM, slices of at least four K steps). On the H200 it helps only the large matrix and
costs more than it gains at SmolLM2's sizes, so the default is one slice.

A tensor core multiplies tiles of at least 16 rows, so a decode step's single row is padded to
``BLOCK_M = 16`` and masked (older Triton versions refuse a smaller ``tl.dot``; newer ones pad it
themselves); in a memory-bound kernel the wasted multiply-adds cost nothing.

Float32 activations: on a GPU ``tl.dot`` rounds float32 operands to TF32 (10 mantissa bits)
unless told ``input_precision="ieee"``, which both kernels say. It makes float32 exact (and
slower: no tensor cores, and more registers, hence 8 warps: ``matmul_warps``) and changes nothing
for bfloat16 or float16, which tensor cores multiply exactly. The interpreter computes in float32
either way, so only a GPU shows the difference.

Each wrapper runs its Triton kernel on CUDA tensors or under TRITON_INTERPRET=1 (see
``paged_cache.py``), and otherwise falls back to its PyTorch reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from minfer.kernels.paged_cache import use_triton
from minfer.formats.weights import dequantize_int4, dequantize_int8


def int8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (q int8 [N, K] * scale [N, 1]).T -> [..., N] in x's dtype, computed in float32."""
    return (x.float() @ dequantize_int8(q, scale).T).to(x.dtype)


def int4_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                          minimum: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W.T with W = unpacked q * scale + min per group -> [..., N] in x's dtype (float32 math)."""
    return (x.float() @ dequantize_int4(packed, scale, minimum).T).to(x.dtype)


@triton.jit
def _int8_matmul_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, K_PER_SPLIT,
                        stride_xm, stride_wn, stride_om, stride_osplit,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)  # this program's slice of K: [k_start, k_end)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(k_start, k_end, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        # int8 values are exact in every float format (bfloat16 holds integers up to 256); float32
        # activations stay float32 with input_precision="ieee" (the GPU default rounds them to TF32).
        acc += tl.dot(x, tl.trans(q.to(x.dtype)), input_precision="ieee")
    scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
    acc = acc * scale[None, :]  # the per-row scale, applied once per output instead of once per weight
    tl.store(out_ptr + split * stride_osplit + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _codes_as_floats(words, DTYPE: tl.constexpr):
    """int32 words [R, C] of eight 4-bit codes each -> [R, 8 * C] floats of DTYPE (float16 or bfloat16) equal
    to MAGIC + code, exactly, columns in order.

    No int-to-float conversion: a code ORed into the low mantissa bits of a float whose last mantissa bit
    is worth 1 *is* that float plus the code: 0x6400 is 1024.0 in float16 (10 mantissa bits), 0x4300 is
    128.0 in bfloat16 (7 bits), and codes 0..15 fit either. One 32-bit shift and one AND-OR (a single
    LOP3 on the GPU) make two such floats, one in each half of the word. Nibble i of word j is column
    8j + i (``pack_int4`` puts column 2b in the low nibble of byte b; a word's bytes are little-endian),
    so half-word pair s holds columns 8j + s and 8j + s + 4.
    """
    magic: tl.constexpr = 0x64006400 if DTYPE == tl.float16 else 0x43004300
    p0 = (words & 0x000F000F) | magic
    p1 = ((words >> 4) & 0x000F000F) | magic
    p2 = ((words >> 8) & 0x000F000F) | magic
    p3 = ((words >> 12) & 0x000F000F) | magic
    c0, c4 = p0.to(tl.int16).to(DTYPE, bitcast=True), (p0 >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    c1, c5 = p1.to(tl.int16).to(DTYPE, bitcast=True), (p1 >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    c2, c6 = p2.to(tl.int16).to(DTYPE, bitcast=True), (p2 >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    c3, c7 = p3.to(tl.int16).to(DTYPE, bitcast=True), (p3 >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    # join sets two tensors side by side along a new last axis, which becomes the lowest bit of the column
    # once reshaped: the outermost join splits even columns from odd, the innermost s from s + 4
    codes = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(codes, [words.shape[0], 8 * words.shape[1]])


@triton.jit
def _int4_matmul_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, M, N, K, K_PER_SPLIT,
                        stride_xm, stride_wn, stride_sn, stride_om, stride_osplit,
                        GROUP_SIZE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    row_ok, col_ok = rows < M, cols < N
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # K and K_PER_SPLIT are multiples of BLOCK_K, which divides GROUP_SIZE: every step lies in one group
    for start in range(k_start, k_end, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None], other=0.0)
        group = start // GROUP_SIZE
        scale = tl.load(scale_ptr + cols * stride_sn + group, mask=col_ok, other=0.0)
        minimum = tl.load(min_ptr + cols * stride_sn + group, mask=col_ok, other=0.0)
        # w_ptr is the packed bytes seen as int32 words of 8 columns each
        if dtype == tl.float32:  # the products run on the CUDA cores (16 per weight): the conversion matters less
            word = tl.load(w_ptr + cols[:, None] * stride_wn + (ks // 8)[None, :], mask=col_ok[:, None], other=0)
            q = ((word >> ((ks % 8) * 4)[None, :]) & 0xF).to(tl.float32)  # the shift picks column k's nibble
            w = q * scale.to(tl.float32)[:, None] + minimum.to(tl.float32)[:, None]
        else:
            words = tl.load(w_ptr + cols[:, None] * stride_wn + (start // 8 + tl.arange(0, BLOCK_K // 8))[None, :],
                            mask=col_ok[:, None], other=0)
            magic: tl.constexpr = 1024.0 if dtype == tl.float16 else 128.0
            codes = _codes_as_floats(words, dtype)  # magic + q, [BLOCK_N, BLOCK_K]
            if dtype == tl.float16:  # (magic + q) - magic is exact; then one multiply-add per two weights (HFMA2)
                w = (codes - magic) * scale[:, None] + minimum[:, None]
            else:  # float32 math, rounded once to bfloat16: scale and minimum keep their float16 bits
                scale32 = scale.to(tl.float32)
                offset = minimum.to(tl.float32) - magic * scale32  # q * s + m = (magic + q) * s + (m - magic * s)
                w = (codes.to(tl.float32) * scale32[:, None] + offset[:, None]).to(dtype)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # exact float32, as above
    tl.store(out_ptr + split * stride_osplit + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


INT8_BLOCK_N, INT4_BLOCK_N = 32, 16  # outputs per program: narrow tiles put more SMs to work on a decode step


def int8_block_k(dtype: torch.dtype) -> int:
    """The int8 kernel's K step: 256 (tuned on an H200) for 16-bit activations, 64 for float32, whose exact
    products need more registers (a 256-wide float32 step spills)."""
    return 64 if dtype == torch.float32 else 256


def int4_block_k(dtype: torch.dtype, group_size: int) -> int:
    """The int4 kernel's K step: 64 for 16-bit activations (tuned on an H200), 32 for float32, never more than
    the group size (a step must lie inside one group)."""
    return min(32 if dtype == torch.float32 else 64, group_size)


def matmul_warps(dtype: torch.dtype) -> int:
    """Warps per program for activations of ``dtype``: 4, but 8 for float32, whose exact products
    (input_precision="ieee") run on the CUDA cores and need more registers than 4 warps have
    without spilling (``benchmarks/kernel_resources.py`` shows each variant's registers)."""
    return 8 if dtype == torch.float32 else 4


def int4_warps(dtype: torch.dtype, block_n: int, block_k: int) -> int:
    """Warps per program for the int4 kernel: ``matmul_warps``, but for 16-bit activations no more threads than
    the tile has int32 words (8 weights each). With fewer words than threads, the words are spread thinner than
    the threads, and their loads and conversions repeat: group 32's 16 x 32 tile spends 30.0 instructions per
    weight with 4 warps, 11.1 with 2 (sm_90, float16, ``benchmarks/sass_inner_loop.py``)."""
    if dtype == torch.float32:
        return matmul_warps(dtype)
    return max(1, min(matmul_warps(dtype), block_n * block_k // 8 // 32))


def num_k_splits(x: torch.Tensor, tiles: int, k_steps: int) -> int:
    """How many slices of K to give each output tile: 1 off CUDA (the interpreter gains nothing) and
    wherever the tiles already give every SM two programs; else enough slices for that, each at least
    four BLOCK_K steps long (shorter slices spend more on their partials than they gain)."""
    if x.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count  # torch caches the properties
    return max(1, min(triton.cdiv(2 * sms, tiles), k_steps // 4))


def k_slices(x: torch.Tensor, n: int, k: int, block_m: int, block_n: int, block_k: int,
             num_splits: Optional[int]) -> tuple[int, int]:
    """(slices of K, BLOCK_K steps per slice) for x [..., K] @ W.T with W [N, K]: num_splits as given
    (1 to the number of K steps), or None for ``num_k_splits``' choice, with no slice left empty."""
    rows = x.numel() // x.shape[-1]
    k_steps = triton.cdiv(k, block_k)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
    splits = num_k_splits(x, tiles, k_steps) if num_splits is None else num_splits
    if not 1 <= splits <= k_steps:
        raise ValueError(f"num_splits must be between 1 and the {k_steps} K steps of {block_k}, got {splits}")
    steps = triton.cdiv(k_steps, splits)
    return (triton.cdiv(k_steps, steps) if num_splits is None else splits), steps  # 25 steps: 5 slices of 5, not 6


def _launch(x: torch.Tensor, n: int, k: int, block_m: int, block_n: int, block_k: int, num_splits: Optional[int]):
    """x as rows [M, K], the output [splits, M, N] (x's dtype unsplit, float32 partials split), the grid, K per slice."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    splits, steps = k_slices(x2, n, k, block_m, block_n, block_k, num_splits)
    out = torch.empty(splits, x2.shape[0], n, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    return x2, out, (triton.cdiv(x2.shape[0], block_m), triton.cdiv(n, block_n), splits), steps * block_k


def _finish(out: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """The slices' partials summed (in float32) and cast; a single slice as it is."""
    out = out[0] if out.shape[0] == 1 else out.sum(0).to(x.dtype)
    return out.reshape(*x.shape[:-1], n)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, *, block_m: int = 16,
                block_n: int = INT8_BLOCK_N, block_k: Optional[int] = None, num_splits: Optional[int] = 1) -> torch.Tensor:
    """The Triton kernel for ``int8_matmul_reference`` (same arguments, same result within float rounding).

    q is int8 [N, K] and scale float32 [N] (made contiguous if they are not). The block sizes are tuning knobs
    (powers of two, at least 16; block_k by default ``int8_block_k``); num_splits slices K (split-K; None:
    ``num_k_splits`` chooses). Falls back to the reference off CUDA without TRITON_INTERPRET=1.
    """
    if not use_triton(x):
        return int8_matmul_reference(x, q, scale)
    block_k = block_k or int8_block_k(x.dtype)
    n, k = q.shape
    q, scale = q.contiguous(), scale.contiguous()  # the kernel walks rows by one stride: no transposed views
    x2, out, grid, k_per_split = _launch(x, n, k, block_m, block_n, block_k, num_splits)
    _int8_matmul_kernel[grid](x2, q, scale, out, x2.shape[0], n, k, k_per_split,
                              x2.stride(0), q.stride(0), out.stride(1), out.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=matmul_warps(x.dtype))
    return _finish(out, x, n)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, *,
                block_m: int = 16, block_n: int = INT4_BLOCK_N, block_k: Optional[int] = None,
                num_splits: Optional[int] = 1, num_warps: Optional[int] = None) -> torch.Tensor:
    """The Triton kernel for ``int4_matmul_reference`` (same arguments, same result within float rounding).

    packed: uint8 [N, K // 2]; scale, minimum: float16 [N, K // group_size] (made contiguous if they are not). block_k must
    divide the group size (default: ``int4_block_k``); num_splits slices K (split-K; None:
    ``num_k_splits`` chooses); num_warps by default ``int4_warps``. Falls back to the reference off CUDA
    without TRITON_INTERPRET=1.
    """
    n, k = packed.shape[0], packed.shape[1] * 2
    group_size = k // scale.shape[1]
    block_k = block_k or int4_block_k(x.dtype, group_size)
    if group_size % block_k:
        raise ValueError(f"block_k ({block_k}) must divide the group size ({group_size})")
    if not use_triton(x):
        return int4_matmul_reference(x, packed, scale, minimum)
    if k % 8:
        raise ValueError(f"the int4 kernel reads 8 columns per int32 word: K must be a multiple of 8, got {k}")
    packed, scale, minimum = packed.contiguous(), scale.contiguous(), minimum.contiguous()  # one stride per row
    words = packed.view(torch.int32)  # 8 codes per word: the kernel loads 4 bytes at a time
    x2, out, grid, k_per_split = _launch(x, n, k, block_m, block_n, block_k, num_splits)
    _int4_matmul_kernel[grid](x2, words, scale, minimum, out, x2.shape[0], n, k, k_per_split,
                              x2.stride(0), words.stride(0), scale.stride(0), out.stride(1), out.stride(0),
                              GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                              num_warps=num_warps or int4_warps(x.dtype, block_n, block_k))
    return _finish(out, x, n)
