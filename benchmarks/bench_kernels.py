"""Paged decode attention on a GPU: the Triton kernel vs the PyTorch reference, as a share of memory bandwidth.

    python benchmarks/bench_kernels.py                          # a table over context lengths
    python benchmarks/bench_kernels.py --peak-gbps 4800 --json decode.json

A decode step reads every cached K and V byte of the batch once and does almost no math on it, so
its speed limit is memory bandwidth. The figure that says how close a kernel comes is

    bandwidth fraction = bytes of K/V read / kernel time / peak bandwidth

It matters most at long contexts, where K/V dominate everything else a step reads. The peak is the
datasheet figure if you pass --peak-gbps (an H100 SXM: 3350 GB/s; an H200: 4800), otherwise what a
large device-to-device copy achieves here (a lower, attainable ceiling). Rows with KV "int8" read
an int8 cache (a float32 scale per token and KV head, counted in the bytes): about half the bytes
of bfloat16, so at the same bandwidth share the step takes about half the time. Needs CUDA: on a
CPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import sys
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


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=["auto", "int8"], default=["auto", "int8"],
                        help="auto: pools in the model dtype (bfloat16); int8: int8 pools + float32 scales")
    parser.add_argument("--peak-gbps", type=float, default=None, help="datasheet peak, GB/s (default: a measured copy)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: this benchmark needs CUDA (Triton kernels compile for GPUs); nothing to measure here.")
        return 0

    peak = args.peak_gbps * 1e9 if args.peak_gbps else None
    peak = peak or measure_memory_bandwidth(size_mb=1024, device="cuda")  # measured once, shared by every row
    rows = [kernel_bandwidth(num_seqs=args.num_seqs, context_len=n, block_size=args.block_size, peak_bytes_per_s=peak,
                             kv_cache_dtype=kind)
            for n in args.context_lens for kind in args.kv_cache_dtypes]
    print(f"| context | KV | K/V MiB | kernel ms | reference ms | kernel GB/s | fraction of {rows[0]['peak_gb_per_s']:.0f} GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        kind = "int8" if row["kv_cache_dtype"] == "int8" else row["dtype"]
        print(f"| {row['context_len']} | {kind} | {row['kv_mb']:.0f} | {row['kernel_ms']:.3f} | {row['reference_ms']:.3f} "
              f"| {row['kernel_gb_per_s']:.0f} | {row['bandwidth_fraction']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
