"""PyTorch's int8 and int4 CPU kernels against a float32 matmul, by rows: where the kernels stop paying.

    python benchmarks/bench_quant_matmul_cpu.py [--threads 1] [--out N] [--in K]

One weight matrix of SmolLM2-135M's shape (gate_up_proj, 3072 x 576, random values), multiplied by
R rows of float32 activations, each way timed side by side in one process (best of 5):
- float32: F.linear on the float32 matrix;
- int8 kernel: `torch.ops.aten._weight_int8pack_mm` on bfloat16 activations;
- int8 dense: the int8 matrix dequantized to float32, then F.linear (the dequantization is timed too);
- int8_mm_cpu: what minfer runs, the kernel below INT8_DENSE_FROM_ROWS rows and dense from there on;
- int4 kernel: `torch.ops.aten._weight_int4pack_mm_for_cpu`, group size 64.
The kernels' time grows in step with the rows, the float32 matmul's more slowly: read the ratios.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from minfer.lab.bench.common import best_time
from minfer.formats.weights import dequantize_int8, pack_int4, quantize_int4_groupwise, quantize_int8_per_channel
from minfer.quant.torch_ops import CPU_COMPUTE_DTYPE, INT8_DENSE_FROM_ROWS, int4_mm_cpu, int8_mm_cpu, pack_int4_for_cpu

ROWS = (1, 4, 16, 32, 64, 128, 256, 512)
GROUP_SIZE = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=int, default=3072, help="output features (N)")
    parser.add_argument("--in", dest="in_features", type=int, default=576, help="input features (K)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.out, args.in_features) * 0.02
    q, scale = quantize_int8_per_channel(weight)
    codes, group_scale, group_min = quantize_int4_groupwise(weight, GROUP_SIZE)
    int4_weight, scale_and_zero = pack_int4_for_cpu(pack_int4(codes), group_scale, group_min)
    bf16_scale = scale.to(CPU_COMPUTE_DTYPE)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); a {args.out} x "
          f"{args.in_features} matrix; int8_mm_cpu goes dense from {INT8_DENSE_FROM_ROWS} rows\n")
    print("| rows | float32 ms | int8 kernel | int8 dense | int8_mm_cpu | int4 kernel | int8 dense / kernel |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for rows in ROWS:
        x = torch.randn(rows, args.in_features)
        ways = {"float32": lambda: F.linear(x, weight),
                "int8 kernel": lambda: torch.ops.aten._weight_int8pack_mm(x.to(CPU_COMPUTE_DTYPE), q, bf16_scale),
                "int8 dense": lambda: F.linear(x, dequantize_int8(q, scale)),
                "int8_mm_cpu": lambda: int8_mm_cpu(x, q, scale),
                "int4 kernel": lambda: int4_mm_cpu(x, int4_weight, scale_and_zero, GROUP_SIZE)}
        ms = {name: best_time(fn, repeats=5) * 1e3 for name, fn in ways.items()}
        base = ms["float32"]
        cells = " | ".join(f"{ms[name]:.2f} ({ms[name] / base:.2f}x)" for name in list(ways)[1:])
        print(f"| {rows} | {base:.2f} | {cells} | {ms['int8 dense'] / ms['int8 kernel']:.2f} |")


if __name__ == "__main__":
    main()
