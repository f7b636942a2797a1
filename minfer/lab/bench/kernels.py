"""Paged decode attention on CUDA: the Triton kernel vs its baselines, as a share of bandwidth.

For benchmarks/bench_kernels.py and chapter 03's GPU cell. A decode step reads every cached K and V byte
of the batch once and does almost no math on it, so its speed limit is memory bandwidth:

    bandwidth fraction = bytes of K/V read / kernel time / peak bandwidth

Two baselines: the kernel's PyTorch reference ("gather": copy each sequence's blocks out, then softmax), and
PyTorch's scaled_dot_product_attention over a contiguous cache of the same tokens ("sdpa": the FlashAttention
backend, what the step would cost if the cache were not paged).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from minfer.lab.bench.common import best_time
from minfer.lab.bench.decode_speed import measure_memory_bandwidth

BASELINES = ("gather", "sdpa")


def contiguous_cache(pool: torch.Tensor, block_tables: torch.Tensor, context_len: int,
                     scales: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Every sequence's first context_len tokens of a pool, copied out in order: [num_seqs, num_kv_heads,
    context_len, head_dim] in dtype (default the pool's), dequantized with scales (an int8 or fp8 pool's)."""
    from minfer.kernels.paged_cache import gather_kv

    rows = [gather_kv(pool, table, context_len, scales) for table in block_tables]
    return torch.stack(rows).transpose(1, 2).to(dtype or pool.dtype).contiguous()


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One decode query per sequence over a contiguous cache, by PyTorch's FlashAttention backend.

    q [num_seqs, num_heads, head_dim]; k, v [num_seqs, num_kv_heads, context_len, head_dim] (GQA: each
    KV head serves num_heads // num_kv_heads query heads). Returns [num_seqs, num_heads, head_dim]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    return out[:, :, 0]


def _time_ms(fn: Callable[[], object], device: str) -> float:
    """Milliseconds per call: triton's do_bench on CUDA, else the best of 3 wall-clock runs (a CPU rehearsal)."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn)
    return best_time(fn, repeats=3, device=device) * 1e3


def kernel_bandwidth(num_seqs: int = 32, context_len: int = 4096, num_heads: int = 32, num_kv_heads: int = 8,
                     head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                     peak_bytes_per_s: Optional[float] = None, kv_cache_dtype: str = "auto",
                     baselines: Sequence[str] = ("gather",), device: str = "cuda") -> dict:
    """Time one paged decode step, the kernel and each of baselines; return times, GB/s and the kernel's fraction of peak.

    baselines: "gather" (reference_ms), "sdpa" (sdpa_ms, sdpa_gb_per_s; its contiguous cache holds the same
    tokens in dtype, so for an int8 cache it reads about twice the bytes). kv_cache_dtype "int8": int8 pools
    with their float32 scale pools, as LLM(kv_cache_dtype="int8") keeps them. device: "cuda"; a CPU rehearsal
    passes "cpu" (the kernel then runs under TRITON_INTERPRET=1, or falls back to its reference)."""
    import triton

    from minfer.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference

    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise ValueError(f"baselines must be among {BASELINES}, got {sorted(unknown)}")
    blocks_per_seq = triton.cdiv(context_len, block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    scales = {}
    if kv_cache_dtype == "int8":
        k_pool = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        v_pool = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        scales = {"k_scales": torch.rand(shape[:3], device=device) / 127, "v_scales": torch.rand(shape[:3], device=device) / 127}
    else:
        k_pool = torch.randn(shape, dtype=dtype, device=device)
        v_pool = torch.randn(shape, dtype=dtype, device=device)
    # Shuffled blocks, as after a while of serving: a sequence's pages are not neighbours in memory.
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(num_seqs, blocks_per_seq)
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device=device)

    kernel_ms = _time_ms(lambda: paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, **scales), device)
    vector_bytes = head_dim * k_pool.element_size() + (4 if scales else 0)  # one (token, KV head) of K or V
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * vector_bytes
    peak = peak_bytes_per_s or measure_memory_bandwidth(size_mb=1024, device=device)
    achieved = kv_bytes / (kernel_ms / 1e3)
    row = {
        "num_seqs": num_seqs, "context_len": context_len, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "block_size": block_size, "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_cache_dtype, "kv_mb": kv_bytes / 2**20, "kernel_ms": kernel_ms,
        "kernel_gb_per_s": achieved / 1e9, "peak_gb_per_s": peak / 1e9, "bandwidth_fraction": achieved / peak,
    }
    if "gather" in baselines:
        row["reference_ms"] = _time_ms(
            lambda: paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens, **scales), device)
    if "sdpa" in baselines:
        k, v = (contiguous_cache(pool, block_tables, context_len, scales.get(name), dtype)
                for pool, name in ((k_pool, "k_scales"), (v_pool, "v_scales")))
        row["sdpa_ms"] = _time_ms(lambda: sdpa_decode(q, k, v), device)
        row["sdpa_gb_per_s"] = (k.nbytes + v.nbytes) / (row["sdpa_ms"] / 1e3) / 1e9
    return row


# Llama-3.1-8B's linears (N x K): q, k and v together, o, gate and up together, down
LLAMA_8B_LINEARS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def quant_operands(n: int, k: int, rows: int, dtype: torch.dtype = torch.bfloat16, group_sizes: Sequence[int] = (64,),
                   device: str = "cuda") -> tuple:
    """Random operands for x [rows, K] @ W.T, W [N, K]: (x, W in dtype, (q8, s8) int8,
    {group size: (packed, s4, m4)} int4), every format quantized from the same float weights."""
    from minfer.formats.weights import pack_int4, quantize_int4_groupwise, quantize_int8_per_channel

    w = torch.randn(n, k, device=device) * 0.02
    x = torch.randn(rows, k, device=device, dtype=dtype)
    int4 = {}
    for g in group_sizes:
        q4, s4, m4 = quantize_int4_groupwise(w, g)
        int4[g] = (pack_int4(q4), s4, m4)
    return x, w.to(dtype), quantize_int8_per_channel(w), int4


def quant_matmul_speed(n: int, k: int, rows: int = 1, dtype: torch.dtype = torch.bfloat16,
                       group_sizes: Sequence[int] = (64,), device: str = "cuda") -> list[dict]:
    """Time x [rows, K] @ W.T for W [N, K] on CUDA: dense (``F.linear``), the int8 kernel and the int4 kernel in
    each of group_sizes unsplit (the engine's default tiles) and with the K slices ``num_k_splits`` chooses, and
    fp8 weights (W8A8 through ``torch._scaled_mm``, the activations quantized on the fly) on a GPU from sm_89 on;
    the weight bytes each reads per second. At decode sizes the unsplit grid leaves most SMs idle: the split
    rows show whether cutting K pays for its two extra launches. Rows carry their int4 group size (else None)."""
    import triton.testing

    from minfer.formats.fp8 import quantize_fp8_rows
    from minfer.formats.hardware import FP8_CAPABILITY, cuda_capability
    from minfer.quant.fp8_linear import Fp8Linear
    from minfer.kernels.quant_matmul import (INT4_BLOCK_N, INT8_BLOCK_N, int4_block_k, int4_matmul, int8_block_k,
                                             int8_matmul, k_slices)

    x, dense, (q8, s8), int4 = quant_operands(n, k, rows, dtype, group_sizes, device)
    auto = {None: k_slices(x, n, k, 16, INT8_BLOCK_N, int8_block_k(dtype), None)[0]}  # by int4 group size
    auto.update({g: k_slices(x, n, k, 16, INT4_BLOCK_N, int4_block_k(dtype, g), None)[0] for g in int4})
    cases = [("dense", None, None, lambda: torch.nn.functional.linear(x, dense), n * k * dense.element_size())]
    for splits in (1, None):  # unsplit (the engine's default), then the slices num_k_splits chooses
        cases.append(("int8", None, splits or f"auto: {auto[None]}",
                      lambda s=splits: int8_matmul(x, q8, s8, num_splits=s), q8.numel() + 4 * n))
        for g, (packed, s4, m4) in int4.items():
            cases.append(("int4", g, splits or f"auto: {auto[g]}",
                          lambda s=splits, p=packed, sc=s4, mn=m4: int4_matmul(x, p, sc, mn, num_splits=s),
                          packed.numel() + 2 * s4.numel() * s4.element_size()))
    capability = cuda_capability(x.device)
    if capability is not None and capability >= FP8_CAPABILITY:  # e4m3 weights, W8A8 through torch._scaled_mm
        fp8 = Fp8Linear(*quantize_fp8_rows(dense.float()), None, backend="torch")
        cases.append(("fp8", None, None, lambda: fp8(x), fp8.qweight.numel() + 4 * n))
    results = []
    for fmt, group_size, splits, run, nbytes in cases:
        us = triton.testing.do_bench(run) * 1e3
        results.append({"n": n, "k": k, "rows": rows, "dtype": str(dtype).removeprefix("torch."), "format": fmt,
                        "group_size": group_size, "splits": splits, "us": us,
                        "weight_gb_per_s": nbytes / (us / 1e6) / 1e9})
    return results
