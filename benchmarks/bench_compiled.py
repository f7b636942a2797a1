"""Eager vs enforce_eager=False decode steps, side by side in one run: through torch.compile on a CPU,
replayed as CUDA graphs on CUDA (minfer/engine/cuda_graphs.py).

    python benchmarks/bench_compiled.py                      # SmolLM2-135M on CPU, bfloat16, batch 1 and 16
    python benchmarks/bench_compiled.py --device cuda --random-weights smollm2-135m --json out.json

For each dtype it loads the model twice (eager and compiled), then for each batch size times greedy
decoding with both, interleaved, best of --repeats, and reports the compile time (the first run of
each new batch bucket; on CUDA, recording its graph) and whether both generated the same tokens. The numbers behind the default of
`enforce_eager` (see minfer/config.py) come from here.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from minfer.lab.bench.common import machine_info, write_docs_section
from minfer.lab.bench.decode_speed import make_prompts, time_minfer
from minfer.lab.bench.timing import best_of
from minfer.llm import LLM
from minfer.lab.testing import MODEL_SHAPES, random_checkpoint

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DOCS_START, DOCS_END = "<!-- bench_compiled:start -->", "<!-- bench_compiled:end -->"


def run(model: str, device: str, dtypes: list[str], batch_sizes: list[int], max_tokens: int, repeats: int) -> dict:
    machine = machine_info(device)
    rows = []
    for dtype in dtypes:
        llms = {eager: LLM(model, dtype=dtype, device=device, enforce_eager=eager) for eager in (True, False)}
        prompts = make_prompts(llms[True].config.vocab_size, max(batch_sizes), 64)
        for batch in batch_sizes:
            start = time.perf_counter()
            time_minfer(llms[False], prompts, 2, batch, warmup=False)  # compiles this batch's bucket
            compile_s = time.perf_counter() - start
            timings = {True: [], False: []}
            for _ in range(repeats):
                for eager, llm in llms.items():
                    timings[eager].append(time_minfer(llm, prompts, max_tokens, batch))
            best = {eager: best_of(ts) for eager, ts in timings.items()}
            same = best[True].extra["token_ids"] == best[False].extra["token_ids"]
            rows.append({"dtype": dtype, "batch_size": batch, "eager_tpot_s": best[True].tpot_s,
                         "compiled_tpot_s": best[False].tpot_s, "speedup": best[True].tpot_s / best[False].tpot_s,
                         "first_compiled_run_s": compile_s, "same_tokens": same})
    return {"benchmark": "compiled", "model": model, "machine": machine, "max_tokens": max_tokens, "repeats": repeats,
            "rows": rows}


def format_markdown(result: dict, command: str) -> str:
    m = result["machine"]
    hw = m.get("gpu") or f"{m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads)"
    name = "CUDA graphs" if str(m["device"]).startswith("cuda") else "compiled"
    lines = [f"Command: `{command}`  ", f"Machine: {hw}; torch {m['torch']}, device {m['device']}  ",
             f"Model: {result['model']}; prompts of 64 tokens, {result['max_tokens']} greedy tokens, "
             f"best of {result['repeats']}", "",
             f"| dtype | batch | eager TPOT (ms) | {name} TPOT (ms) | {name} speedup | first {name} run (s) | same tokens |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['dtype']} | {r['batch_size']} | {r['eager_tpot_s'] * 1e3:.1f} | {r['compiled_tpot_s'] * 1e3:.1f} "
                     f"| {r['speedup']:.2f}× | {r['first_compiled_run_s']:.0f} | {'yes' if r['same_tokens'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--random-weights", choices=sorted(MODEL_SHAPES), default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--update-docs", nargs="?", const=str(DOCS_PAGE), default=None, metavar="PATH")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_compiled.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = random_checkpoint(tmp, args.random_weights) if args.random_weights else args.model
        result = run(model, args.device, args.dtypes, args.batch_sizes, args.max_tokens, args.repeats)
    if args.random_weights:
        result["model"] = f"random weights, {args.random_weights} shapes"
    markdown = format_markdown(result, command.strip())
    print(markdown)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    if args.update_docs:
        write_docs_section(markdown, args.update_docs, DOCS_START, DOCS_END, "## Compiled decode (`enforce_eager=False`)",
                           "A decode step through `torch.compile` against the same step run eagerly, same model, "
                           "one process. How it is compiled: `minfer/engine/compiled_decode.py`.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
