"""Which tiles suit the int8/int4 matmul kernels on this GPU: every (block_n, block_k, K slices) timed beside dense.

    python benchmarks/tune_quant_matmul.py --json tune.json     # needs CUDA; on a CPU it says so and exits 0
    python benchmarks/tune_quant_matmul.py --shapes llama --rows 1 16 --group-sizes 64 128

The kernels' first defaults (64 outputs per program, K steps of 64 for int8 and 32 for int4, K unsplit) were
chosen without a GPU; this script's H200 figures set the present ones (``minfer/kernels/quant_matmul.py``). At decode sizes the grid is small (N / block_n programs for one
row), so the tile width decides how many SMs read weights at all, and the K step how many bytes each load brings.
This script times each choice at the shapes of ``bench_kernels.py`` and prints, per shape and row count, dense
bfloat16, the first defaults, and the fastest choice: the figures to set the defaults from (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Optional

import torch

from minfer.lab.bench.kernels import LLAMA_8B_LINEARS

SHAPES = {"default": [(3072, 576), (576, 1536), (4096, 14336)],  # SmolLM2's gate_up and down, Llama-3.1-8B's down
          "llama": LLAMA_8B_LINEARS}
BLOCK_N = (16, 32, 64, 128)
BLOCK_K = {"int8": (32, 64, 128, 256), "int4": (16, 32, 64, 128)}  # int4's step must divide the group size
WARPS = (None, 2, 4)  # int4 only: fewer warps leave each thread more weights per step (docs/kernels.md)
FIRST_DEFAULTS = {"int8": (64, 64, 1), "int4": (64, 32, 1)}  # (block_n, block_k, num_splits) before the GPU run


def time_us(run) -> float:
    """Microseconds per call (Triton's do_bench)."""
    import triton.testing

    return triton.testing.do_bench(run, warmup=10, rep=40) * 1e3


def tune(n: int, k: int, rows: int, group_sizes: tuple = (64,), device: str = "cuda") -> list[dict]:
    """Every tile choice of int8 and of int4 in each group size, timed, with dense ``F.linear`` beside them."""
    from minfer.lab.bench.kernels import quant_operands
    from minfer.kernels.quant_matmul import int4_matmul, int8_matmul

    x, dense, (q8, s8), int4 = quant_operands(n, k, rows, torch.bfloat16, group_sizes, device)
    calls = {"int8": lambda **tiles: int8_matmul(x, q8, s8, block_m=16, **tiles)}
    for g, (packed, s4, m4) in int4.items():  # the same weights, quantized in groups of g
        calls[f"int4 g{g}"] = lambda p=packed, s=s4, m=m4, **tiles: int4_matmul(x, p, s, m, block_m=16, **tiles)

    want = {fmt: call(block_n=64, block_k=32, num_splits=1).float() for fmt, call in calls.items()}
    out = [{"n": n, "k": k, "rows": rows, "format": "dense", "us": time_us(lambda: torch.nn.functional.linear(x, dense))}]
    for fmt, call in calls.items():
        group = int(fmt.split("g")[-1]) if fmt.startswith("int4") else None
        block_ks = [b for b in BLOCK_K[fmt.split()[0]] if group is None or group % b == 0]
        warps = WARPS if fmt.startswith("int4") else (None,)  # None: the kernel's own choice (int4_warps)
        for block_n, block_k, splits, num_warps in itertools.product(BLOCK_N, block_ks, (1, None), warps):
            tiles = dict(block_n=block_n, block_k=block_k, num_splits=splits)
            if num_warps:
                tiles["num_warps"] = num_warps
            row = {"n": n, "k": k, "rows": rows, "format": fmt, **tiles}
            try:
                got = call(**tiles).float()
                row["agrees"] = ((got - want[fmt]).abs().max() / want[fmt].abs().max()).item() < 1e-2
                row["us"] = time_us(lambda: call(**tiles))
            except Exception as exc:  # a choice this GPU or Triton refuses: noted, the others still timed
                row.update(agrees=False, error=f"{type(exc).__name__}: {exc}"[:300])
            out.append(row)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--shapes", choices=list(SHAPES), default="default", help="which matrices (N x K) to time")
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[64], choices=[32, 64, 128],
                        help="int4 group sizes (the first also sets the rows of the int4 first defaults)")
    parser.add_argument("--json", help="also write every timed row to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_quant_matmul: needs CUDA (the Triton kernels compile for GPUs); nothing to time here.")
        return 0
    shapes = SHAPES[args.shapes]
    rows = [r for (n, k), m in itertools.product(shapes, args.rows) for r in tune(n, k, m, tuple(args.group_sizes))]
    print("| N x K | rows | dense us | format | first defaults us | best us | best (block_n, block_k, splits) | "
          "dense / best |")
    print("|---|---:|---:|---|---:|---:|---|---:|")
    for (n, k), m in itertools.product(shapes, args.rows):
        mine = [r for r in rows if (r["n"], r["k"], r["rows"]) == (n, k, m)]
        dense = next(r["us"] for r in mine if r["format"] == "dense")
        for fmt in ["int8"] + [f"int4 g{g}" for g in args.group_sizes]:
            timed = [r for r in mine if r["format"] == fmt and r["agrees"]]
            first = FIRST_DEFAULTS[fmt.split()[0]]
            default = next((f"{r['us']:.1f}" for r in timed if (r["block_n"], r["block_k"], r["num_splits"]) == first
                            and not r.get("num_warps")), "-")
            best = min(timed, key=lambda r: r["us"])
            print(f"| {n} x {k} | {m} | {dense:.1f} | {fmt} | {default} | {best['us']:.1f} | "
                  f"({best['block_n']}, {best['block_k']}, {best['num_splits'] or 'auto'}"
                  f"{', %d warps' % best['num_warps'] if best.get('num_warps') else ''}) | {dense / best['us']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
