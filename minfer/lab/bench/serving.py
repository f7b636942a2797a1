"""Serving benchmarks: many requests at once, as a server sees them (chapters 03-05 and `bench_serving.py`).

Three questions, each measured side by side in one process on the same model:

1. Throughput and latency of a mixed workload (`serving_workload.make_workload`: prompts sliced from the
   Python documentation shipped with CPython, output lengths spread widely, EOS ignored so every request
   generates exactly what the workload says) under minfer continuous batching, minfer static batching
   (same max_num_seqs), one request at a time, and transformers' `generate` on left-padded static
   batches (`serving_engines`). Output tokens/s, requests/s, TTFT and TPOT (mean, p50, p99), KV memory.
2. KV memory waste (`serving_workload.kv_waste`): what a contiguous cache reserves (max_model_len per
   sequence, or batch x (longest prompt + longest output) for a static batch) against what paged blocks
   hold (at most one partly filled block per sequence), on the same lengths.
3. Prefix caching (`serving_prefix.run_prefix_experiment`): a shared system prompt with and without the
   cache, the shared part placed after the per-request part, retrieved passages in a stable vs a shuffled
   order.

`run_serving_benchmark` runs all three and returns the result that `serving_report` formats.
"""
from __future__ import annotations

import tempfile
import time
from typing import Optional

import torch

from minfer.lab.bench.common import hf_checkpoint_for, load_transformers, machine_info
from minfer.lab.bench.serving_engines import run_minfer, run_sequential, run_transformers, warm_up
from minfer.lab.bench.serving_prefix import run_prefix_experiment
from minfer.lab.bench.serving_workload import kv_waste, make_workload

PRESETS = {
    "full": dict(num_requests=128, prompt_len=(32, 384), output_len=(16, 512), subset=16, max_num_seqs=32,
                 prefix_requests=32, system_tokens=512, prefix_max_tokens=16, passage_tokens=128, num_passages=4),
    "quick": dict(num_requests=16, prompt_len=(8, 64), output_len=(4, 32), subset=4, max_num_seqs=8,
                  prefix_requests=8, system_tokens=64, prefix_max_tokens=4, passage_tokens=32, num_passages=3),
}


def run_serving_benchmark(model: str = "smollm2-135m", dtype: str = "bfloat16", quick: bool = False,
                          transformers: bool = True, prefix: bool = True, progress: bool = True,
                          seed: int = 0, kv_cache_memory_bytes: Optional[int] = None, **overrides) -> dict:
    """The serving benchmark in one process: see the module docstring. Returns a JSON-able dict."""
    from minfer.llm import LLM

    settings = {**PRESETS["quick" if quick else "full"], **{k: v for k, v in overrides.items() if v is not None}}
    log = print if progress else (lambda *a, **k: None)
    started = time.perf_counter()
    machine = machine_info("cpu")
    llm = LLM(model, dtype=dtype, device="cpu", max_num_seqs=settings["max_num_seqs"],
              kv_cache_memory_bytes=kv_cache_memory_bytes)
    workload = make_workload(llm.tokenizer, settings["num_requests"], settings["prompt_len"], settings["output_len"], seed)
    subset = workload[:settings["subset"]]
    n_seqs = settings["max_num_seqs"]
    warm_up(llm, workload)
    rows = []
    log(f"[serving] {len(workload)} requests: minfer continuous")
    rows.append(run_minfer(llm, workload, "continuous", n_seqs))
    log("[serving] minfer static")
    rows.append(run_minfer(llm, workload, "static", n_seqs))
    log(f"[serving] subset of {len(subset)}: minfer continuous")
    rows.append(run_minfer(llm, subset, "continuous", n_seqs, name="minfer continuous (subset)"))
    log("[serving] subset: one by one")
    rows.append(run_sequential(llm, subset))
    for row in rows[2:]:
        row["subset"] = True
    if transformers:
        log("[serving] subset: transformers")
        with tempfile.TemporaryDirectory(prefix="minfer_serving_") as tmp:
            hf_model, hf_tok = load_transformers(hf_checkpoint_for(model, tmp), dtype, "cpu")
            with torch.inference_mode():  # warm-up
                hf_model.generate(torch.tensor([subset[0].prompt_token_ids]), max_new_tokens=2, do_sample=False)
            row = run_transformers(hf_model, hf_tok, subset, n_seqs)
            row["subset"] = True
            rows.append(row)
            del hf_model
    try:
        import llama_cpp  # noqa: F401  (optional; not measured yet)
        llama_note = "llama_cpp is importable but not measured by this script"
    except ImportError:
        llama_note = "llama-cpp-python not installed: skipped"
    bpt = llm.config.kv_bytes_per_token(llm.dtype, llm.engine.config.kv_cache_dtype)
    counts = llm.engine.snapshot()
    waste = kv_waste([len(r.prompt_token_ids) for r in workload], [r.max_tokens for r in workload], bpt,
                     counts.block_size, n_seqs, llm.max_model_len)
    prefix_result = None
    if prefix:
        log("[serving] prefix caching")
        prefix_result = run_prefix_experiment(llm, settings["prefix_requests"], settings["system_tokens"],
                                              settings["prefix_max_tokens"], settings["passage_tokens"],
                                              settings["num_passages"], n_seqs)
    by = {r["engine"]: r for r in rows}
    cont = by["minfer continuous"]["output_tokens_per_s"]
    ratios = {"continuous_vs_static": cont / by["minfer static"]["output_tokens_per_s"],
              "continuous_vs_sequential": cont / by["minfer one by one"]["output_tokens_per_s"],
              "subset_continuous_vs_sequential": by["minfer continuous (subset)"]["output_tokens_per_s"]
              / by["minfer one by one"]["output_tokens_per_s"]}
    hf_row = by.get("transformers generate (padded batches)")
    if hf_row:
        ratios["continuous_vs_transformers"] = cont / hf_row["output_tokens_per_s"]
        ratios["subset_continuous_vs_transformers"] = (by["minfer continuous (subset)"]["output_tokens_per_s"]
                                                       / hf_row["output_tokens_per_s"])
    return {"benchmark": "serving", "model": model, "dtype": dtype, "preset": "quick" if quick else "full",
            "settings": {**settings, "seed": seed, "greedy": True, "ignore_eos": True,
                         "block_size": counts.block_size, "max_num_batched_tokens": counts.token_budget,
                         "max_model_len": llm.max_model_len,
                         "workload_prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
                         "workload_output_tokens": sum(r.max_tokens for r in workload)},
            "machine": machine, "rows": rows, "ratios": ratios, "kv_waste": waste, "kv_bytes_per_token": bpt,
            "prefix": prefix_result, "llama_cpp": llama_note, "elapsed_s": time.perf_counter() - started}
