"""The generate benchmark: `benchmarks/bench_generate.py` and `python -m minfer bench`.

minfer vs transformers `generate` vs the bare-matmul floor, on the same weights and the same prompts,
in one process: every dtype and batch size timed in turn (`decode_speed`, `transformers_timing`), the
best of a few repeats kept (`timing.best_of`), then reported (`generate_report`).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from minfer.lab.bench.common import add_update_docs_argument, hf_checkpoint_for, load_transformers, machine_info
from minfer.lab.bench.decode_speed import (make_prompts, matmul_floor, measure_memory_bandwidth,
                                           model_bandwidth_utilisation, time_minfer, weight_bytes)
from minfer.lab.bench.generate_report import format_markdown, ratios, update_docs
from minfer.lab.bench.timing import Timing, best_of
from minfer.lab.bench.transformers_timing import time_transformers
from minfer.lab.testing import MODEL_SHAPES, random_checkpoint

PRESETS = {
    # tokens per sequence, repeats (best of), prompt length, floor steps
    "quick": dict(max_tokens=16, repeats=1, prompt_len=32, floor_steps=8),
    "full": dict(max_tokens=48, repeats=3, prompt_len=64, floor_steps=24),
}


def run_generate_benchmark(model: str = "smollm2-135m", dtypes: Sequence[str] = ("float32", "bfloat16"),
                           batch_sizes: Sequence[int] = (1, 16), max_tokens: int = 48, prompt_len: int = 64,
                           repeats: int = 3, floor_steps: int = 24, device: str = "cpu",
                           engines: Sequence[str] = ("minfer", "transformers"), progress: bool = True,
                           random_weights: Optional[str] = None, bandwidth_mb: int = 256) -> dict:
    """minfer vs transformers generate vs the matmul floor, same weights, same prompts, one process.

    For every dtype and batch size the three are timed in turn, `repeats` times, and the best of
    each is kept (interference from other processes only ever adds time). Returns a JSON-able dict.
    """
    from minfer.llm import LLM

    unknown = set(engines) - {"minfer", "transformers"}
    if unknown:
        raise ValueError(f"unknown engines {sorted(unknown)}: use minfer and/or transformers")
    started = time.perf_counter()
    machine = machine_info(device)  # before we load the machine ourselves
    tasks = len(dtypes) * len(batch_sizes) * repeats * (2 + len(engines)) + 1
    bar = tqdm(total=tasks, desc="bench", disable=not progress, leave=False)
    with tempfile.TemporaryDirectory(prefix="minfer_bench_") as tmp:
        bar.set_postfix_str("preparing weights")
        if random_weights:
            folder = random_checkpoint(tmp, random_weights)
        else:
            folder = hf_checkpoint_for(model, tmp)
        bar.set_postfix_str("memory bandwidth")
        # a GPU copies 256 MB in about 0.1 ms, too short to time well: 2 GB there
        bandwidth = measure_memory_bandwidth(bandwidth_mb if torch.device(device).type == "cpu" else max(bandwidth_mb, 2048),
                                             device=device)
        bar.update()
        rows: list[Timing] = []
        per_step_bytes = {}
        for dtype in dtypes:
            bar.set_postfix_str(f"loading {dtype}")
            llm = LLM(folder, dtype=dtype, device=device)
            hf = load_transformers(folder, dtype, device) if "transformers" in engines else None
            per_step_bytes[dtype] = weight_bytes(llm.model)
            prompts = make_prompts(llm.config.vocab_size, max(batch_sizes), prompt_len)
            for batch in batch_sizes:
                timings: dict[str, list[Timing]] = {}
                for r in range(repeats):
                    runs = {"matmul floor": lambda: matmul_floor(llm.model, batch, floor_steps),
                            "F.linear floor": lambda: matmul_floor(llm.model, batch, floor_steps, plain=True)}
                    if "minfer" in engines:
                        runs["minfer"] = lambda: time_minfer(llm, prompts, max_tokens, batch, warmup=r == 0)
                    if "transformers" in engines:
                        runs["transformers"] = lambda: time_transformers(hf[0], hf[1], prompts, max_tokens, batch,
                                                                         warmup=r == 0)
                    for name, run in runs.items():  # interleaved, so a busy moment hits all of them alike
                        bar.set_postfix_str(f"{dtype} batch {batch} {name} ({r + 1}/{repeats})")
                        timings.setdefault(name, []).append(run())
                        bar.update()
                best = {name: best_of(ts) for name, ts in timings.items()}
                if "minfer" in best and "transformers" in best:
                    a, b = best["minfer"].extra["token_ids"], best["transformers"].extra["token_ids"]
                    same = sum(x == y for x, y in zip(a, b)) / len(a)
                    best["minfer"].extra["same_tokens_as_transformers"] = same
                for t in best.values():
                    t.extra.pop("token_ids", None)
                    t.mbu = model_bandwidth_utilisation(per_step_bytes[dtype], t.tpot_s, bandwidth)
                    rows.append(t)
            del llm, hf
    bar.close()
    return {
        "benchmark": "generate",
        "model": random_weights and f"random weights, {random_weights} shapes" or model,
        "settings": {"dtypes": list(dtypes), "batch_sizes": list(batch_sizes), "max_tokens": max_tokens,
                     "prompt_len": prompt_len, "repeats": repeats, "floor_steps": floor_steps,
                     "engines": list(engines), "greedy": True, "ignore_eos": True},
        "machine": machine,
        "memory_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_per_step": per_step_bytes,
        "rows": [t.as_dict() for t in rows],
        "ratios": ratios(rows),
        "elapsed_s": time.perf_counter() - started,
    }


def add_bench_arguments(parser: argparse.ArgumentParser, docs_page: Union[str, Path, None] = None) -> None:
    """The benchmark's options. `--update-docs PATH` writes the table into the docs page at PATH; a
    script that knows where its docs page is passes it as `docs_page`, and `--update-docs` alone then
    means that page."""
    parser.add_argument("--quick", action="store_true", help="a short run (fewer tokens, one repeat) to check that it works")
    parser.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF directory")
    parser.add_argument("--random-weights", choices=sorted(MODEL_SHAPES), default=None,
                        help="benchmark random weights of these shapes instead of a model file")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--engines", nargs="+", default=["minfer", "transformers"])
    parser.add_argument("--max-tokens", type=int, help="tokens generated per sequence (quick 16, full 48)")
    parser.add_argument("--prompt-len", type=int, help="prompt length in tokens (quick 32, full 64)")
    parser.add_argument("--repeats", type=int, help="runs per measurement, best kept (quick 1, full 3)")
    parser.add_argument("--floor-steps", type=int, help="decode steps timed for the matmul floor")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", dest="json_path", help="write the results here as JSON")
    parser.add_argument("--markdown", dest="markdown_path", help="write the markdown table here")
    add_update_docs_argument(parser, docs_page)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def bench_from_args(args: argparse.Namespace, command: Optional[str] = None) -> dict:
    """Run the benchmark with the parsed options: print the markdown, write what the options ask for."""
    preset = dict(PRESETS["quick" if args.quick else "full"])
    for key in preset:
        if getattr(args, key, None) is not None:
            preset[key] = getattr(args, key)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_generate_benchmark(model=args.model, dtypes=args.dtypes, batch_sizes=args.batch_sizes,
                                    device=args.device, engines=args.engines, progress=not args.no_progress,
                                    random_weights=args.random_weights, **preset)
    command = command or "python -m minfer bench " + " ".join(sys.argv[2:])
    result["command"] = command
    markdown = format_markdown(result, command)
    print(markdown)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.markdown_path:
        Path(args.markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_path).write_text(markdown)
    if args.update_docs:
        update_docs(markdown, args.update_docs)
    return result
