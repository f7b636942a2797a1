"""What one forward pass costs against its token count: the curve behind minfer/engine/buckets.py.

    python benchmarks/step_cost.py [--dtype bfloat16] [--threads 2]

A step of T tokens (no KV cache, so attention is small) is timed for T from 1 to 512, best of 5.
Where the time stays flat, padding a step up to a larger size is free; where it grows with T,
buckets must lie close together.
"""
from __future__ import annotations

import argparse

import torch

from minfer import LLM
from minfer.lab.bench.common import best_time

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = LLM(args.model, dtype=args.dtype, device="cpu").model
    print("| tokens | ms per step | ms per token |\n|---:|---:|---:|")
    for size in SIZES:
        ids, positions = torch.zeros(1, size, dtype=torch.long), torch.arange(size)[None]
        seconds = best_time(lambda: model(ids, positions), repeats=5)
        print(f"| {size} | {seconds * 1e3:.1f} | {seconds * 1e3 / size:.2f} |", flush=True)


if __name__ == "__main__":
    main()
