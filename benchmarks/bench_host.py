"""The host's work per decode step, this checkout beside another one, in one run.

    python benchmarks/bench_host.py [--baseline DIR] [--steps 40] [--rounds 2] [--update-docs]

Runs `minfer.lab.bench.host` (the same harness as `python -m minfer bench host`: a tiny model, 1, 32
and 256 decoding sequences, greedy and mixed sampling, and greedy streamed) in a child process on this checkout's
minfer and, with --baseline, on the minfer of another checkout (e.g. `git worktree add DIR COMMIT`),
alternating for --rounds rounds; each configuration keeps its best round. The harness file is this
checkout's in both, so both are measured the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minfer.lab.bench.common import machine_info, write_docs_section  # noqa: E402
from minfer.lab.bench.host import HostRow, table  # noqa: E402

DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench_host:start -->", "<!-- bench_host:end -->"
HARNESS = ROOT / "minfer" / "lab" / "bench" / "host.py"
CHILD = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("host_harness", sys.argv[1])
host = importlib.util.module_from_spec(spec); sys.modules["host_harness"] = host; spec.loader.exec_module(host)
torch.set_num_threads(1)
rows = host.run_host_bench(tuple(int(b) for b in sys.argv[3].split(",")), int(sys.argv[4]))
json.dump([vars(r) for r in rows], open(sys.argv[2], "w"))
"""


def run_tree(tree: Path, batches: list[int], steps: int) -> list[HostRow]:
    """The harness on `tree`'s minfer, in a child process (one torch thread)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-c", CHILD, str(HARNESS), out.name, ",".join(map(str, batches)), str(steps)],
                       env=env, check=True, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return [HostRow(**r) for r in json.load(open(out.name))]


def best(rounds: list[list[HostRow]]) -> list[HostRow]:
    return [min(same, key=lambda r: r.host_us_per_seq) for same in zip(*rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout's root, measured beside this one")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--update-docs", action="store_true", help=f"rewrite the section in {DOCS_PAGE.name}")
    args = parser.parse_args()
    trees = {"this checkout": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    rounds: dict[str, list] = {name: [] for name in trees}
    for i in range(args.rounds):
        for name, tree in trees.items():
            print(f"round {i + 1}: {name}", flush=True)
            rounds[name].append(run_tree(tree, args.batches, args.steps))
    results = {name: best(r) for name, r in rounds.items()}
    lines = []
    for name, rows in results.items():
        lines += [f"**{name}**", "", table(rows), ""]
    if args.baseline:
        lines += ["| sampling | sequences | host µs per sequence: baseline, this checkout | baseline / this checkout "
                  "| ATen ops: baseline, this checkout |", "|---|---|---|---|---|"]
        for new, old in zip(results["this checkout"], results["baseline"]):
            lines.append(f"| {new.sampling} | {new.batch} | {old.host_us_per_seq:.1f}, {new.host_us_per_seq:.1f} "
                         f"| {old.host_us_per_seq / new.host_us_per_seq:.2f}x | {old.ops_per_step}, {new.ops_per_step} |")
    report = "\n".join(lines)
    print(report)
    if args.update_docs:
        info = machine_info()
        command = "python benchmarks/bench_host.py" + (" --baseline DIR" if args.baseline else "")
        body = (f"Measured with `{command}` ({args.rounds} rounds, best of each) on {info['cpu']}, "
                f"{info['cores']} cores, one torch thread, torch {info['torch']}.\n\n{report}\n")
        write_docs_section(body, DOCS_PAGE, START, END, "## The host's work per decode step",
                           "A tiny model (SmolLM2's tokenizer, 2 layers 64 wide, a 512-token vocabulary), so that what "
                           "is left beside the forward pass is the engine's own work: scheduling, packing the step, "
                           "sampling, text, outputs. ATen operations are what a GPU would launch as kernels.")
        print(f"updated {DOCS_PAGE}")


if __name__ == "__main__":
    main()
