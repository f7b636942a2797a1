"""The MoE layer's CPU paths side by side: the reference loop, the grouped (sorted) path, and a gathered bmm.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_layer.py                  # prints the table
    OMP_NUM_THREADS=1 python benchmarks/bench_moe_layer.py --update-docs    # and writes docs/benchmarks.md

`minfer.layers.moe.moe_mlp` on random weights, float32, one torch thread, for T tokens routed top-k
of E. "reference" finds each expert's pairs with a `where` per expert; "grouped" sorts the pairs by
expert once and runs each used expert's run; "gathered" (written here only, to show why it is not
in the library) copies each pair's expert matrices out and runs all pairs through two batched
matmuls. Each cell: the fastest of 3 rounds that alternate the paths, each round the best of 3 calls.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from minfer.lab.bench.common import best_time, machine_info, write_docs_section
from minfer.layers.moe import moe_mlp, route_topk

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DOCS_START, DOCS_END = "<!-- bench_moe_layer:start -->", "<!-- bench_moe_layer:end -->"
# (experts, top-k, hidden, expert intermediate): Mixtral's 8 x top-2 and a fine-grained 32 x top-4 (Qwen-MoE
# style), at SmolLM2's hidden size: 1,536 and 1,024 active neurons per token
SHAPES = [(8, 2, 576, 768), (32, 4, 576, 256)]
TOKENS = (1, 4, 16, 64, 256)
GATHERED_UP_TO = 16  # tokens: beyond, the gathered path takes seconds a call


def gathered(x, weights, expert_ids, gate_up, down) -> torch.Tensor:
    flat = expert_ids.reshape(-1)
    h = x.repeat_interleave(expert_ids.shape[1], dim=0).unsqueeze(-1)
    gate, up = torch.bmm(gate_up[flat], h).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(down[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return (y.view(*expert_ids.shape, -1) * weights.unsqueeze(-1)).sum(1)


def measure(rounds: int = 3) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for experts, top_k, hidden, inter in SHAPES:
        gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02
        down = torch.randn(experts, hidden, inter, generator=gen) * 0.02
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, generator=gen)
            weights, ids = route_topk(torch.randn(tokens, experts, generator=gen) * 3, top_k, normalize=True)
            paths = {"reference": lambda: moe_mlp(x, weights, ids, gate_up, down, "reference"),
                     "grouped": lambda: moe_mlp(x, weights, ids, gate_up, down, "grouped"),
                     "gathered": lambda: gathered(x, weights, ids, gate_up, down)}
            if tokens > GATHERED_UP_TO:
                del paths["gathered"]
            best = {name: float("inf") for name in paths}
            with torch.inference_mode():
                for _ in range(rounds):
                    for name, fn in paths.items():
                        best[name] = min(best[name], best_time(fn, 3))
            rows.append(dict(experts=experts, top_k=top_k, hidden=hidden, intermediate=inter, tokens=tokens,
                             distinct=int(ids.unique().numel()), **{f"{k}_ms": v * 1e3 for k, v in best.items()}))
            print(rows[-1], flush=True)
    return rows


def markdown(rows: list[dict], info: dict) -> str:
    lines = ["| E x top-k (F) | tokens | experts used | reference ms | grouped ms | gathered ms | reference / grouped |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['experts']} x {r['top_k']} ({r['intermediate']}) | {r['tokens']} | {r['distinct']} | "
                     f"{r['reference_ms']:.2f} | {r['grouped_ms']:.2f} | {r.get('gathered_ms', float('nan')):.1f} | "
                     f"{r['reference_ms'] / r['grouped_ms']:.2f}x |")
    lines.append("")
    lines.append(f"`OMP_NUM_THREADS=1 python benchmarks/bench_moe_layer.py --update-docs`; float32, hidden 576, one "
                 f"torch thread on {info['cpu']}, torch {torch.__version__}; the {info['cores']} cores were shared with "
                 f"other jobs (load average {info['load_average_1min']:.1f}), so single cells are noisy (the paths "
                 f"alternate within each round); gathered: not run (nan) beyond {GATHERED_UP_TO} tokens.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure()
    info = machine_info()
    table = markdown(rows, info)
    print(table)
    if args.update_docs:
        write_docs_section(table, DOCS_PAGE, DOCS_START, DOCS_END, "## The MoE layer on the CPU",
                           "The CPU paths of `minfer.layers.moe.moe_mlp` (`auto` takes `grouped` on the CPU, the fused "
                           "Triton kernels on CUDA). What the table shows: a call's time follows the number of distinct "
                           "experts whose weights it reads far more than the path; grouped is 1.0-1.25x the reference "
                           "(once 2x), and copying each pair's experts out for a batched matmul (gathered) is 4-40x "
                           "slower, which is why the library has no such path.")


if __name__ == "__main__":
    main()
