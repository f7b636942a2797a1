"""Prepacked linears (minfer.layers.linear) against F.linear, by rows, and the whole forward pass they are part of.

    python benchmarks/bench_packed_linears.py [--dtype bfloat16] [--threads 1]

Part 1 calls the model's 121 linears (30 layers of four, plus the head) on random inputs of R rows: once as F.linear
on the plain weights (what an unpacked nn.Linear runs), once through the model's own PackedLinear layers. Part 2
times one forward pass of T tokens (no KV cache) with the packed layers, then with the same weights as plain
nn.Linear. Part 3 times a training step (forward and backward over 128 tokens, the float32 weights of QAT and
of the draft's distillation) with bfloat16 autocast and without. Each pair runs side by side in one process, best
of 3 or 5; the ratios are what to read. On a CPU without bfloat16 instructions (AVX2 only) a bfloat16 PackedLinear
multiplies through a float32 copy from WIDE_FROM_ROWS rows on, and `bf16_autocast` leaves autocast off.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from minfer import LLM
from minfer.lab.bench.common import best_time
from minfer.layers import linear
from minfer.layers.linear import WIDE_FROM_ROWS, PackedLinear, bf16_autocast, packed_dtype, unpack_linears
from minfer.lab.distill import final_hidden

ROWS = (1, 2, 3, 4, 8, 16, 64, 256)
TOKENS = (1, 8, 32, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = LLM(args.model, dtype=args.dtype, device="cpu").model
    dtype = next(model.parameters()).dtype
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); {dtype} weights are "
          f"packed as {packed_dtype(dtype)} (float32 copy from {WIDE_FROM_ROWS} rows on where that differs)\n")
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    widened = packed_dtype(dtype) not in (dtype, None)  # a float32 copy of bfloat16 weights: WIDE_FROM_ROWS applies
    print(f"Part 1: the model's {len(layers)} linears; 'float32 copy' forces the copy at every row count (where "
          f"there is one)\n\n| rows | F.linear ms | packed ms | packed / F.linear | float32 copy ms | copy / F.linear |\n"
          "|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for rows in ROWS:
            inputs = {n: torch.randn(rows, n, dtype=dtype) for n in {layer.in_features for layer in layers}}
            plain_s = best_time(lambda: [F.linear(inputs[m.in_features], m.weight, m.bias) for m in layers], repeats=5)
            packed_s = best_time(lambda: [m(inputs[m.in_features]) for m in layers], repeats=5)
            copy = "| - | -"
            if widened:
                linear.WIDE_FROM_ROWS = 1
                copy_s = best_time(lambda: [m(inputs[m.in_features]) for m in layers], repeats=5)
                linear.WIDE_FROM_ROWS = WIDE_FROM_ROWS
                copy = f"| {copy_s * 1e3:.1f} | {copy_s / plain_s:.2f}"
            print(f"| {rows} | {plain_s * 1e3:.1f} | {packed_s * 1e3:.1f} | {packed_s / plain_s:.2f} {copy} |", flush=True)

        print("\nPart 2: one forward pass of T tokens\n\n| tokens | plain nn.Linear ms | packed ms | packed / plain |\n"
              "|---:|---:|---:|---:|")
        times = {}
        for packed in (True, False):
            if not packed:
                unpack_linears(model)
            for size in TOKENS:
                ids, positions = torch.zeros(1, size, dtype=torch.long), torch.arange(size)[None]
                model(ids, positions)  # first call packs (or warms oneDNN)
                times[packed, size] = best_time(lambda: model(ids, positions))
        for size in TOKENS:
            packed_s, plain_s = times[True, size], times[False, size]
            print(f"| {size} | {plain_s * 1e3:.1f} | {packed_s * 1e3:.1f} | {packed_s / plain_s:.2f} |")

    with bf16_autocast("cpu"):
        minfer_autocasts = torch.is_autocast_enabled("cpu")
    print(f"\nPart 3: a training step, 128 tokens, float32 weights (minfer's bf16_autocast here: "
          f"{'on' if minfer_autocasts else 'off'})")
    model.float().requires_grad_(True)
    ids = torch.randint(0, 40000, (1, 128))

    def step(autocast: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # as QAT's logits_of, forced on or off
            loss = F.linear(final_hidden(model, ids), model.lm_head.weight).float().logsumexp(-1).mean()
        loss.backward()

    step(True), step(False)  # warm-up
    seconds = {autocast: best_time(lambda: step(autocast)) for autocast in (True, False)}
    print(f"\n| float32 s | bf16 autocast s | autocast / float32 |\n|---:|---:|---:|\n"
          f"| {seconds[False]:.2f} | {seconds[True]:.2f} | {seconds[True] / seconds[False]:.2f} |")


if __name__ == "__main__":
    main()
