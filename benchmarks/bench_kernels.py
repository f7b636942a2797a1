"""Paged decode attention on a GPU: the Triton kernel vs the PyTorch reference, as a share of memory bandwidth;
then the int8/int4 matmul kernels against dense bfloat16 at decode sizes, unsplit and split-K.

    python benchmarks/bench_kernels.py                          # two tables
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

from minfer.lab.bench.decode_speed import measure_memory_bandwidth
from minfer.lab.bench.kernels import LLAMA_8B_LINEARS, kernel_bandwidth, quant_matmul_speed

# (N, K) of weight matrices: SmolLM2-135M's qkv, gate_up and down projections, and Llama-3.1-8B's down projection;
# or all of Llama-3.1-8B's linears
MATMUL_SHAPES = {"default": [(960, 576), (3072, 576), (576, 1536), (4096, 14336)], "llama": LLAMA_8B_LINEARS}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-lens", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=["auto", "int8"], default=["auto", "int8"],
                        help="auto: pools in the model dtype (bfloat16); int8: int8 pools + float32 scales")
    parser.add_argument("--peak-gbps", type=float, default=None, help="datasheet peak, GB/s (default: a measured copy)")
    parser.add_argument("--matmul-rows", type=int, nargs="*", default=[1, 16],
                        help="activation rows of the quantized matmuls (decode batch sizes); no value: skip them")
    parser.add_argument("--matmul-shapes", choices=list(MATMUL_SHAPES), default="default",
                        help="which weight matrices (N x K) the matmuls time")
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[64], choices=[32, 64, 128],
                        help="int4 group sizes (each has int4 rows of its own)")
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
    save(args.json, rows, [])  # kept even if the time limit stops the matmuls
    matmuls = [r for m in args.matmul_rows for n, k in MATMUL_SHAPES[args.matmul_shapes]
               for r in quant_matmul_speed(n, k, rows=m, group_sizes=args.group_sizes)]
    if matmuls:
        print("\n| N x K | rows | format | K slices | us | weight GB/s | time / dense |")
        print("|---|---:|---|---|---:|---:|---:|")
        for r in matmuls:
            dense = next(d for d in matmuls if (d["n"], d["k"], d["rows"], d["format"]) == (r["n"], r["k"], r["rows"], "dense"))
            fmt = f"{r['format']} g{r['group_size']}" if r["group_size"] else r["format"]
            print(f"| {r['n']} x {r['k']} | {r['rows']} | {fmt} | {r['splits'] or '-'} | {r['us']:.1f} "
                  f"| {r['weight_gb_per_s']:.0f} | {r['us'] / dense['us']:.2f} |")
    save(args.json, rows, matmuls)
    return 0


def save(path: Optional[str], rows: list[dict], matmuls: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "matmuls": matmuls}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
