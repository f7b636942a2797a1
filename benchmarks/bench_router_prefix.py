"""Chapter 08's router tasks answered in batches, with and without the shared system turn computed once.

    python benchmarks/bench_router_prefix.py [--rounds 2] [--batch-size 32] [--dtype float32]

Every router task's prompt starts with the chat template's system turn. `minfer.lab.router.greedy_answers`
computes those tokens once and copies their keys and values into every row of the batch, as a prefix cache
would share them. This runs `answer_tasks` over the 117 tasks (`make_tasks(per_kind=10, seed=0)`, chapter 08's)
both ways in one process, alternating for --rounds rounds (best round each): "without" is the same function
with the shared prefix's length forced to 0, so every row computes its whole prompt. The answers must agree.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minfer import LLM  # noqa: E402
from minfer.lab import router  # noqa: E402
from minfer.lab.bench.common import machine_info  # noqa: E402
from minfer.lab.router_tasks import answer_tasks, make_tasks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM("smollm2-135m", dtype=args.dtype, device="cpu")
    tasks = make_tasks(per_kind=10, seed=0)
    best, answers = {"with the shared prefix": float("inf"), "without": float("inf")}, {}
    for _ in range(args.rounds):
        for name in best:
            without = mock.patch.object(router, "shared_prefix_length", lambda prompts: 0)
            with without if name == "without" else contextlib.nullcontext():
                start = time.perf_counter()
                rows = answer_tasks(llm.model, llm.tokenizer, tasks, batch_size=args.batch_size)
                best[name] = min(best[name], time.perf_counter() - start)
            answers[name] = [row["answer"] for row in rows]
    info = machine_info()
    print(f"{info['cpu']}, one torch thread, torch {info['torch']}, {args.dtype}, {len(tasks)} tasks in batches of "
          f"{args.batch_size}, best of {args.rounds} rounds")
    print(f"without the shared prefix: {best['without']:.1f} s; with it: {best['with the shared prefix']:.1f} s "
          f"({best['without'] / best['with the shared prefix']:.2f}x); same answers: "
          f"{answers['without'] == answers['with the shared prefix']}")


if __name__ == "__main__":
    main()
