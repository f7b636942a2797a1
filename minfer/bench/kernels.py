"""Paged decode attention on CUDA: the Triton kernel vs its PyTorch (gather) reference, as a share of bandwidth.

For benchmarks/bench_kernels.py and chapter 03's GPU cell. A decode step reads every cached K and V byte
of the batch once and does almost no math on it, so its speed limit is memory bandwidth:

    bandwidth fraction = bytes of K/V read / kernel time / peak bandwidth
"""
from __future__ import annotations

from typing import Optional

import torch

from minfer.bench.generate import measure_memory_bandwidth


def kernel_bandwidth(num_seqs: int = 32, context_len: int = 4096, num_heads: int = 32, num_kv_heads: int = 8,
                     head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                     peak_bytes_per_s: Optional[float] = None, kv_cache_dtype: str = "auto") -> dict:
    """Time one paged decode step (kernel and reference) on CUDA; return times, GB/s and the fraction of peak.

    kv_cache_dtype "int8": int8 pools with their float32 scale pools, as LLM(kv_cache_dtype="int8") keeps them."""
    import triton.testing

    from minfer.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference

    blocks_per_seq = triton.cdiv(context_len, block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    scales = {}
    if kv_cache_dtype == "int8":
        k_pool = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
        v_pool = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda")
        scales = {"k_scales": torch.rand(shape[:3], device="cuda") / 127, "v_scales": torch.rand(shape[:3], device="cuda") / 127}
    else:
        k_pool = torch.randn(shape, dtype=dtype, device="cuda")
        v_pool = torch.randn(shape, dtype=dtype, device="cuda")
    # Shuffled blocks, as after a while of serving: a sequence's pages are not neighbours in memory.
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(num_seqs, blocks_per_seq)
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device="cuda")
    q = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device="cuda")

    kernel_ms = triton.testing.do_bench(
        lambda: paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, **scales))
    reference_ms = triton.testing.do_bench(
        lambda: paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens, **scales))
    vector_bytes = head_dim * k_pool.element_size() + (4 if scales else 0)  # one (token, KV head) of K or V
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * vector_bytes
    peak = peak_bytes_per_s or measure_memory_bandwidth(size_mb=1024, device="cuda")
    achieved = kv_bytes / (kernel_ms / 1e3)
    return {
        "num_seqs": num_seqs, "context_len": context_len, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "block_size": block_size, "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_cache_dtype,
        "kv_mb": kv_bytes / 2**20, "kernel_ms": kernel_ms, "reference_ms": reference_ms,
        "kernel_gb_per_s": achieved / 1e9, "peak_gb_per_s": peak / 1e9, "bandwidth_fraction": achieved / peak,
    }


def quant_operands(n: int, k: int, rows: int, dtype: torch.dtype = torch.bfloat16, group_size: int = 64,
                   device: str = "cuda") -> tuple:
    """Random operands for x [rows, K] @ W.T, W [N, K]: (x, W in dtype, (q8, s8) int8, (packed, s4, m4) int4)."""
    from minfer.formats.weights import pack_int4, quantize_int4_groupwise, quantize_int8_per_channel

    w = torch.randn(n, k, device=device) * 0.02
    x = torch.randn(rows, k, device=device, dtype=dtype)
    q4, s4, m4 = quantize_int4_groupwise(w, group_size)
    return x, w.to(dtype), quantize_int8_per_channel(w), (pack_int4(q4), s4, m4)


def quant_matmul_speed(n: int, k: int, rows: int = 1, dtype: torch.dtype = torch.bfloat16, group_size: int = 64,
                       device: str = "cuda") -> list[dict]:
    """Time x [rows, K] @ W.T for W [N, K] on CUDA: dense (``F.linear``), the int8 and int4 kernels unsplit
    (the engine's default tiles) and with the K slices ``num_k_splits`` chooses; the
    weight bytes each reads per second. At decode sizes the unsplit grid leaves most SMs idle: the split
    rows show whether cutting K pays for its two extra launches."""
    import triton.testing

    from minfer.kernels.quant_matmul import (INT4_BLOCK_N, INT8_BLOCK_N, int4_block_k, int4_matmul, int8_block_k,
                                             int8_matmul, k_slices)

    x, dense, (q8, s8), (packed, s4, m4) = quant_operands(n, k, rows, dtype, group_size, device)
    auto = {"int8": k_slices(x, n, k, 16, INT8_BLOCK_N, int8_block_k(dtype), None)[0],
            "int4": k_slices(x, n, k, 16, INT4_BLOCK_N, int4_block_k(dtype, group_size), None)[0]}
    cases = [("dense", None, lambda: torch.nn.functional.linear(x, dense), n * k * dense.element_size())]
    for splits in (1, None):  # unsplit (the engine's default), then the slices num_k_splits chooses
        cases.append(("int8", splits, lambda s=splits: int8_matmul(x, q8, s8, num_splits=s), q8.numel() + 4 * n))
        cases.append(("int4", splits, lambda s=splits: int4_matmul(x, packed, s4, m4, num_splits=s),
                      packed.numel() + 2 * s4.numel() * s4.element_size()))
    results = []
    for fmt, splits, run, nbytes in cases:
        us = triton.testing.do_bench(run) * 1e3
        results.append({"n": n, "k": k, "rows": rows, "dtype": str(dtype).removeprefix("torch."), "format": fmt,
                        "splits": f"auto: {auto[fmt]}" if fmt != "dense" and splits is None else splits, "us": us,
                        "weight_gb_per_s": nbytes / (us / 1e6) / 1e9})
    return results
