"""Serving benchmarks: many requests at once, as a server sees them (chapters 03-05 and `bench_serving.py`).

Three questions, each measured side by side in one process on the same model:

1. Throughput and latency of a mixed workload (`make_workload`: prompts sliced from the Python
   documentation shipped with CPython, `pydoc_data.topics`, output lengths spread widely, EOS
   ignored so every request generates exactly what the workload says) under
   minfer continuous batching, minfer static batching (same max_num_seqs), one request at a time,
   and transformers' `generate` on left-padded static batches. Output tokens/s, requests/s, TTFT
   and TPOT (mean, p50, p99), KV memory.
2. KV memory waste (`kv_waste`): what a contiguous cache reserves (max_model_len per sequence, or
   batch x (longest prompt + longest output) for a static batch) against what paged blocks hold
   (at most one partly filled block per sequence), on the same lengths.
3. Prefix caching (`run_prefix_experiment`): a shared system prompt with and without the cache,
   the shared part placed after the per-request part, retrieved passages in a stable vs a
   shuffled order: prefill tokens computed, hit rate, median TTFT, each on a warmed engine (the
   process's first, cold request is reported apart).

Timing conventions (the same as `minfer.lab.bench.generate`): TTFT counts from the moment a request is
handed to the engine (for a batch run, all requests are handed over at once, so TTFT includes
queueing); TPOT is (last token time - first token time) / (tokens - 1) of each request.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import os
import random
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from minfer.lab.bench.common import (StepClock, hf_checkpoint_for, load_transformers, machine_info, synchronize,
                                 write_docs_section)

DOCS_START = "<!-- bench_serving:start -->"
DOCS_END = "<!-- bench_serving:end -->"
# Targets on CPU: continuous batching against one by one and against transformers, and what prefix caching saves
# (prefill tokens) and buys (TTFT).
TARGETS = {"continuous_vs_sequential": 6.0, "continuous_vs_transformers": 3.0,
           "prefill_tokens_saved": 0.90, "ttft_speedup": 5.0}

PRESETS = {
    "full": dict(num_requests=128, prompt_len=(32, 384), output_len=(16, 512), subset=16, max_num_seqs=32,
                 prefix_requests=32, system_tokens=512, prefix_max_tokens=16, passage_tokens=128, num_passages=4),
    "quick": dict(num_requests=16, prompt_len=(8, 64), output_len=(4, 32), subset=4, max_num_seqs=8,
                  prefix_requests=8, system_tokens=64, prefix_max_tokens=4, passage_tokens=32, num_passages=3),
}


# --------------------------------------------------------------------------- the workload

@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def corpus_text() -> str:
    """Real English text that needs no download: the Python documentation topics shipped with CPython."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def text_tokens(tokenizer, num_tokens: int, rng: random.Random, text: Optional[str] = None) -> list[int]:
    """`num_tokens` token ids of a slice of the corpus starting at a random place (deterministic given rng)."""
    text = text or corpus_text()
    width = 8 * num_tokens + 64  # characters: comfortably more than num_tokens tokens of English
    for _ in range(8):
        start = rng.randrange(0, max(1, len(text) - width))
        ids = tokenizer.encode(text[start:start + width], add_special_tokens=False)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        width *= 2
    raise ValueError(f"could not cut {num_tokens} tokens out of the corpus")


def make_workload(tokenizer, num_requests: int = 128, prompt_len: tuple[int, int] = (32, 384),
                  output_len: tuple[int, int] = (16, 512), seed: int = 0, output_dist: str = "loguniform") -> list[Request]:
    """Requests with lengths in the given inclusive ranges (fixed seed): prompt lengths uniform, output
    lengths log-uniform (as many between 16 and 64 as between 128 and 512: many short answers, a long
    tail, as in chat traffic) or uniform."""
    if num_requests < 1 or not 1 <= prompt_len[0] <= prompt_len[1] or not 1 <= output_len[0] <= output_len[1]:
        raise ValueError(f"bad workload: {num_requests} requests, prompt_len {prompt_len}, output_len {output_len}")
    if output_dist not in ("loguniform", "uniform"):
        raise ValueError(f"output_dist must be 'loguniform' or 'uniform', got {output_dist!r}")
    rng, text = random.Random(seed), corpus_text()
    lo, hi = output_len
    requests = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_len)
        if output_dist == "uniform":
            olen = rng.randint(lo, hi)
        else:
            olen = min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))
        requests.append(Request(text_tokens(tokenizer, plen, rng, text), olen))
    return requests


# --------------------------------------------------------------------------- statistics

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(values: Sequence[Optional[float]]) -> dict:
    """mean, p50, p99 of the values that are not None (seconds)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    return {"mean": sum(vals) / len(vals), "p50": percentile(vals, 50), "p99": percentile(vals, 99)}


def summarize(engine: str, per_request: Sequence[dict], wall_s: float, **extra) -> dict:
    """One row of the results: per_request holds {ttft, tpot, num_output_tokens} of every request."""
    tokens = sum(r["num_output_tokens"] for r in per_request)
    return {"engine": engine, "requests": len(per_request), "output_tokens": tokens, "wall_s": wall_s,
            "output_tokens_per_s": tokens / wall_s, "requests_per_s": len(per_request) / wall_s,
            "ttft": latency_stats([r["ttft"] for r in per_request]),
            "tpot": latency_stats([r["tpot"] for r in per_request]),
            "ttfts": [r["ttft"] for r in per_request], "load_1min_after": _load(), **extra}


def _load() -> Optional[float]:
    """The 1-minute load average (other work on the machine slows every phase it overlaps)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _metrics_rows(outputs) -> list[dict]:
    return [{"ttft": o.metrics.ttft, "tpot": o.metrics.tpot, "num_output_tokens": o.metrics.num_output_tokens}
            for o in outputs]


# --------------------------------------------------------------------------- KV memory

def kv_waste(prompt_lens: Sequence[int], output_lens: Sequence[int], bytes_per_token: int, block_size: int = 16,
             batch_size: int = 32, max_model_len: Optional[int] = None) -> list[dict]:
    """Reserved vs used KV bytes of every request at its largest (the end of its generation), summed.

    used: prompt + output tokens. Schemes:
      * contiguous, max_model_len: every sequence reserves the whole context window up front;
      * contiguous, static batches: batches of batch_size in order, each row reserving
        (longest prompt + longest output of its batch) slots, as `minfer.generate` allocates;
      * paged: whole blocks, so at most one partly filled block per sequence.
    waste = 1 - used / reserved.
    """
    lengths = [p + o for p, o in zip(prompt_lens, output_lens)]
    used = sum(lengths) * bytes_per_token
    schemes = []
    if max_model_len:
        schemes.append(("contiguous, max_model_len per sequence", len(lengths) * max_model_len))
    static = 0
    for start in range(0, len(lengths), batch_size):
        ps, os_ = prompt_lens[start:start + batch_size], output_lens[start:start + batch_size]
        static += len(ps) * (max(ps) + max(os_))
    schemes.append((f"contiguous, static batches of {batch_size}", static))
    schemes.append((f"paged, blocks of {block_size}", sum(-(-n // block_size) * block_size for n in lengths)))
    return [{"scheme": name, "reserved_bytes": slots * bytes_per_token, "used_bytes": used,
             "waste": 1 - used / (slots * bytes_per_token)} for name, slots in schemes]


# --------------------------------------------------------------------------- running the engines

def fresh_engine(llm, max_num_seqs: Optional[int] = None, enable_prefix_caching: Optional[bool] = None):
    """Give `llm` a new serving engine (empty prefix cache, zeroed stats) with the same pool and budgets."""
    from minfer.engine.engine import Engine

    old = llm.engine.config
    config = dataclasses.replace(old, num_gpu_blocks_override=llm.engine.snapshot().num_blocks,
                                 max_num_seqs=max_num_seqs or old.max_num_seqs,
                                 enable_prefix_caching=(old.enable_prefix_caching if enable_prefix_caching is None
                                                        else enable_prefix_caching))
    llm.engine = None  # free the old pool before the new one is allocated
    gc.collect()
    llm.engine = Engine(llm.model, llm.tokenizer, config)
    return llm.engine


def _params(max_tokens: int):
    from minfer.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _check_lengths(outputs, workload: Sequence[Request], engine: str) -> None:
    got = [o.metrics.num_output_tokens for o in outputs]
    want = [r.max_tokens for r in workload]
    if got != want:
        raise RuntimeError(f"{engine}: generated {got[:8]}... tokens, the workload asked for {want[:8]}...")


def warm_up(llm, workload: Sequence[Request]) -> None:
    """A short untimed run, so the first timed one does not pay for allocator and kernel warm-up."""
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload[:4]], _params(4), use_tqdm=False)


def run_minfer(llm, workload: Sequence[Request], batching: str = "continuous", max_num_seqs: int = 32,
               enable_prefix_caching: bool = True, name: Optional[str] = None) -> dict:
    """Every request handed to `llm.generate` at once; continuous (the engine) or static batches."""
    engine = fresh_engine(llm, max_num_seqs, enable_prefix_caching)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, [_params(r.max_tokens) for r in workload], use_tqdm=False, batching=batching)
    wall = time.perf_counter() - start
    name = name or f"minfer {batching}"
    _check_lengths(outputs, workload, name)
    bpt = llm.config.kv_bytes_per_token(llm.dtype, engine.config.kv_cache_dtype)
    extra: dict = {"max_num_seqs": max_num_seqs}
    if batching == "continuous":
        counts = engine.snapshot()
        per_block = counts.block_size * bpt
        extra.update(kv_used_bytes=counts.peak_blocks_used * per_block, kv_reserved_bytes=engine.runner.pool.nbytes,
                     kv_note="peak blocks used x bytes per block / the pool",
                     prefix_hit_rate=counts.prefix_hit_rate, computed_tokens=counts.computed_tokens,
                     steps=counts.steps, preemptions=counts.num_preemptions)
    else:  # the contiguous cache of the largest batch, and the tokens that batch really holds at its end
        batches = [workload[i:i + max_num_seqs] for i in range(0, len(workload), max_num_seqs)]
        reserved = [len(b) * (max(len(r.prompt_token_ids) for r in b) + max(r.max_tokens for r in b)) for b in batches]
        peak = max(range(len(batches)), key=reserved.__getitem__)
        extra.update(kv_reserved_bytes=reserved[peak] * bpt,
                     kv_used_bytes=sum(len(r.prompt_token_ids) + r.max_tokens for r in batches[peak]) * bpt,
                     kv_note="the largest batch's contiguous cache / the tokens it holds at the end")
    return summarize(name, _metrics_rows(outputs), wall, **extra)


def run_sequential(llm, workload: Sequence[Request]) -> dict:
    """One request at a time through the engine: each waits for the previous one to finish.

    TTFT here counts from each request's own submission (no queueing behind the others)."""
    fresh_engine(llm, 1)
    rows, start = [], time.perf_counter()
    for r in workload:
        (out,) = llm.generate([{"prompt_token_ids": r.prompt_token_ids}], _params(r.max_tokens), use_tqdm=False)
        _check_lengths([out], [r], "sequential")
        rows += _metrics_rows([out])
    return summarize("minfer one by one", rows, time.perf_counter() - start,
                     note="TTFT from each request's own submission")


def run_transformers(hf_model, tokenizer, workload: Sequence[Request], batch_size: int = 32) -> dict:
    """transformers' `generate` on static batches: left-padded prompts, each batch runs as long as its longest output.

    Only the tokens each request asked for count as output (the rest of a short request's row is waste).
    TTFT and TPOT come from the time each generate step's logits were ready (`minfer.lab.bench.common.StepClock`),
    TTFT counted from the start of the run, as for minfer's batch runs."""
    from transformers import LogitsProcessorList

    device = next(hf_model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    config = hf_model.generation_config
    saved = config.eos_token_id, config.pad_token_id
    config.eos_token_id, config.pad_token_id = None, pad
    kwargs = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    rows, reserved_peak = [], 0
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            synchronize(device)
            start = time.perf_counter()
            for i in range(0, len(workload), batch_size):
                batch = workload[i:i + batch_size]
                longest = max(len(r.prompt_token_ids) for r in batch)
                steps = max(r.max_tokens for r in batch)
                ids = torch.tensor([[pad] * (longest - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch],
                                   device=device)
                mask = (torch.arange(longest, device=device)[None] >= (longest - torch.tensor(
                    [len(r.prompt_token_ids) for r in batch], device=device))[:, None]).long()
                clock = StepClock()
                hf_model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                                  logits_processor=LogitsProcessorList([clock]), **kwargs)
                if len(clock.times) != steps:
                    raise RuntimeError(f"transformers ran {len(clock.times)} steps, expected {steps}")
                reserved_peak = max(reserved_peak, len(batch) * (longest + steps))
                for r in batch:
                    n = r.max_tokens
                    rows.append({"ttft": clock.times[0] - start, "num_output_tokens": n,
                                 "tpot": (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None})
            wall = time.perf_counter() - start
    finally:
        config.eos_token_id, config.pad_token_id = saved
    return summarize("transformers generate (padded batches)", rows, wall, max_num_seqs=batch_size)


# --------------------------------------------------------------------------- prefix caching

def prefix_scenarios(tokenizer, num_requests: int = 32, system_tokens: int = 512, passage_tokens: int = 128,
                     num_passages: int = 4, seed: int = 1) -> dict[str, list[list[int]]]:
    """Prompts (token ids) for the prefix-caching experiment, all built from the same pieces.

    shared first: a shared system text (system_tokens) then a short per-request question;
    shared after: the question first, then the same shared text (the cache cannot engage);
    passages stable / shuffled: num_passages retrieved passages in a fixed order, or in a new
    random order per request, then the question.
    """
    from pydoc_data.topics import topics

    rng, text = random.Random(seed), corpus_text()
    system = text_tokens(tokenizer, system_tokens, rng, text)
    passages = [text_tokens(tokenizer, passage_tokens, rng, text) for _ in range(num_passages)]
    keys = sorted(topics)
    questions = [tokenizer.encode(f"\n\nQuestion {i}: in one sentence, what is '{rng.choice(keys)}' about?\nAnswer:",
                                  add_special_tokens=False) for i in range(num_requests)]
    shuffled = []
    for q in questions:
        order = list(range(num_passages))
        rng.shuffle(order)
        shuffled.append([t for i in order for t in passages[i]] + q)
    return {"shared first": [system + q for q in questions],
            "shared after": [q + system for q in questions],
            "passages, stable order": [[t for p in passages for t in p] + q for q in questions],
            "passages, shuffled": shuffled}


def run_prefix_case(llm, prompts: list[list[int]], max_tokens: int, enable_prefix_caching: bool, name: str,
                    max_num_seqs: int = 32) -> dict:
    """All prompts at once through a fresh engine: prefill tokens computed, hit rate, TTFT."""
    engine = fresh_engine(llm, max_num_seqs, enable_prefix_caching)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(max_tokens), use_tqdm=False)
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    decode_fed = sum(o.metrics.num_output_tokens - 1 for o in outputs)  # every output token but the last is fed back
    counts = engine.snapshot()
    prefill = counts.computed_tokens - decode_fed
    ttfts = [o.metrics.ttft for o in outputs]
    return {"case": name, "prefix_caching": enable_prefix_caching, "requests": len(prompts),
            "prompt_tokens": prompt_tokens, "prefill_tokens_computed": prefill, "hit_rate": counts.prefix_hit_rate,
            "ttft": latency_stats(ttfts), "ttfts": ttfts, "wall_s": wall, "load_1min_after": _load(),
            "preemptions": counts.num_preemptions}


def run_prefix_experiment(llm, num_requests: int = 32, system_tokens: int = 512, max_tokens: int = 16,
                          passage_tokens: int = 128, num_passages: int = 4, max_num_seqs: int = 32, seed: int = 1) -> dict:
    prompts = prefix_scenarios(llm.tokenizer, num_requests, system_tokens, passage_tokens, num_passages, seed)
    cases = [("shared first", False), ("shared first", True), ("shared after", True),
             ("passages, stable order", True), ("passages, shuffled", True)]
    # The first request a process serves pays one-off costs (on a GPU: loading kernels, choosing matmul
    # algorithms for each new shape). It is measured on its own, then the first case runs once untimed,
    # so that every case below is timed on a warm engine.
    cold = run_prefix_case(llm, prompts["shared first"][:1], max_tokens, False, "first request, cold", max_num_seqs)
    run_prefix_case(llm, prompts["shared first"], max_tokens, False, "warm-up", max_num_seqs)
    rows = []
    for name, caching in cases:
        label = f"{name}, {'prefix caching' if caching else 'no prefix caching'}"
        rows.append(run_prefix_case(llm, prompts[name], max_tokens, caching, label, max_num_seqs))
    off, on = rows[0], rows[1]
    summary = {"prefill_tokens_saved": 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"],
               "ttft_speedup": off["ttft"]["p50"] / on["ttft"]["p50"]}
    return {"settings": {"requests": num_requests, "system_tokens": system_tokens, "max_tokens": max_tokens,
                         "passage_tokens": passage_tokens, "num_passages": num_passages}, "rows": rows,
            "cold": cold, "summary": summary}


# --------------------------------------------------------------------------- the whole benchmark

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


# --------------------------------------------------------------------------- reporting

def _ms(x: float) -> str:
    return "–" if x is None or x != x else f"{x * 1e3:.0f}"


def _mib(x: Optional[float]) -> str:
    return "–" if x is None else f"{x / 2**20:.1f}"


def _check(value: float, target: float) -> str:
    return f"{value:.2f}× {'✓' if value >= target else '✗'} (target ≥ {target:g}×)"


def format_markdown(result: dict, command: Optional[str] = None) -> str:
    m, s = result["machine"], result["settings"]
    lines = []
    busy = m.get("load_average_1min", 0) > max(0, m["cores"] - m["torch_threads"]) + 0.5
    if busy:
        lines.append(f"**Warning: the machine was busy (load average {m['load_average_1min']} on {m['cores']} cores): "
                     "timings are noisy; the ratios below were measured side by side in one run.**\n")
    if command:
        lines.append(f"Command: `{command}`  ")
    lines += [
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), load average "
        f"{m.get('load_average_1min', '?')} at the start; torch {m['torch']}, transformers {m['transformers']}  ",
        f"Model: {result['model']} in {result['dtype']}; greedy, EOS ignored; block size {s['block_size']}, "
        f"max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']}  ",
        f"Workload: {s['num_requests']} requests, prompts of {s['prompt_len'][0]}–{s['prompt_len'][1]} tokens cut from "
        f"`pydoc_data.topics` (the Python docs shipped with CPython), outputs of {s['output_len'][0]}–{s['output_len'][1]} "
        f"tokens (log-uniform: many short, a long tail; seed {s['seed']}): {s['workload_prompt_tokens']} prompt and {s['workload_output_tokens']} "
        f"output tokens. **Subset** rows ran only the first {s['subset']} requests (one by one and transformers are too "
        "slow for all of them here): compare their *rates*, not their totals.",
        "",
        "| engine | requests | output tok/s | req/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) "
        "| KV used / reserved (MiB) | prefix hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        t, p = r["ttft"], r["tpot"]
        kv = f"{_mib(r.get('kv_used_bytes'))} / {_mib(r.get('kv_reserved_bytes'))}" if "kv_used_bytes" in r else "–"
        hit = f"{r['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in r else "–"
        name = r["engine"] + (" *(subset)*" if r.get("subset") and "subset" not in r["engine"] else "")
        lines.append(f"| {name} | {r['requests']} | {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.3f} "
                     f"| {_ms(t['mean'])} / {_ms(t['p50'])} / {_ms(t['p99'])} | {_ms(p['mean'])} / {_ms(p['p50'])} / "
                     f"{_ms(p['p99'])} | {kv} | {hit} |")
    loads = [f"{r['engine']} {r['load_1min_after']}" for r in result["rows"] if r.get("load_1min_after") is not None]
    if loads:
        lines += ["", "Load average (1 min) at the end of each run, on " + f"{m['cores']} cores: " + "; ".join(loads) + "."]
    ra = result["ratios"]
    lines += ["", "Ratios of output tokens/s:", "",
              f"- continuous (all requests) / one by one (subset): {_check(ra['continuous_vs_sequential'], TARGETS['continuous_vs_sequential'])}; "
              f"on the same subset: {ra['subset_continuous_vs_sequential']:.2f}×"]
    if "continuous_vs_transformers" in ra:
        lines.append(f"- continuous (all requests) / transformers padded batches (subset): "
                     f"{_check(ra['continuous_vs_transformers'], TARGETS['continuous_vs_transformers'])}; "
                     f"on the same subset: {ra['subset_continuous_vs_transformers']:.2f}×")
    lines.append(f"- continuous / static batching (all requests, same max_num_seqs): {ra['continuous_vs_static']:.2f}×")
    lines.append(f"- llama.cpp: {result['llama_cpp']}")
    lines += ["", f"KV memory on the same workload ({result['kv_bytes_per_token']} bytes per token; each request "
                  "counted at its largest, summed over requests):", "",
              "| layout | reserved (MiB) | used (MiB) | waste |", "|---|---:|---:|---:|"]
    for w in result["kv_waste"]:
        lines.append(f"| {w['scheme']} | {_mib(w['reserved_bytes'])} | {_mib(w['used_bytes'])} | {w['waste']:.1%} |")
    pr = result.get("prefix")
    if pr:
        ps = pr["settings"]
        lines += ["", f"Prefix caching: {ps['requests']} requests at once, a shared {ps['system_tokens']}-token text "
                      f"(from the same docs) + a short question each, {ps['max_tokens']} output tokens; passages: "
                      f"{ps['num_passages']} × {ps['passage_tokens']} tokens, then the question.", "",
                  "| case | prompt tokens | prefill tokens computed | hit rate | TTFT p50 (ms) | TTFT p99 (ms) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in pr["rows"]:
            lines.append(f"| {r['case']} | {r['prompt_tokens']} | {r['prefill_tokens_computed']} | {r['hit_rate']:.1%} "
                         f"| {_ms(r['ttft']['p50'])} | {_ms(r['ttft']['p99'])} |")
        sm = pr["summary"]
        if "cold" in pr:  # stored results without it still format
            lines += ["", f"Every case above ran on a warmed engine; the process's first request, cold and alone, "
                          f"took {_ms(pr['cold']['ttft']['p50'])} ms to its first token."]
        lines += ["", f"- prefill tokens saved by the cache (shared text first): {sm['prefill_tokens_saved']:.1%} "
                      f"{'✓' if sm['prefill_tokens_saved'] >= TARGETS['prefill_tokens_saved'] else '✗'} "
                      f"(target ≥ {TARGETS['prefill_tokens_saved']:.0%})",
                  f"- median TTFT without / with the cache: {_check(sm['ttft_speedup'], TARGETS['ttft_speedup'])}"]
    return "\n".join(lines) + "\n"


def update_docs_section(markdown: str, path: Union[str, Path], start: str = DOCS_START,
                        end: str = DOCS_END, heading: str = "## Serving: continuous batching, paged KV, prefix caching",
                        intro: str = "") -> None:
    """Replace the serving section of the docs page at `path` (between its markers), or append it."""
    write_docs_section(markdown, path, start, end, heading, intro)


def plot(result: dict, path: Union[str, Path]) -> None:
    """Output tokens/s per engine, the TTFT distribution per engine, and median TTFT of the prefix cases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    panels = 3 if result.get("prefix") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    names = [r["engine"].replace(" (padded batches)", "\n(padded)").replace(" (subset)", "\n(subset)")
             + ("\n(subset)" if r.get("subset") and "subset" not in r["engine"] else "") for r in rows]
    colors = ["tab:green" if "continuous" in r["engine"] else "tab:gray" for r in rows]
    axes[0].barh(names, [r["output_tokens_per_s"] for r in rows], color=colors)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("output tokens / s (higher is better)")
    axes[0].set_title(f"{result['model']} {result['dtype']}, CPU")
    axes[1].boxplot([[t for t in r["ttfts"] if t is not None] for r in rows], vert=False, tick_labels=names)
    axes[1].invert_yaxis()
    axes[1].set_xscale("log")
    axes[1].set_xlabel("TTFT (s, log scale)")
    axes[1].set_title("time to first token")
    if panels == 3:
        pr = result["prefix"]["rows"]
        axes[2].barh([r["case"].replace(", ", "\n", 1) for r in pr], [r["ttft"]["p50"] for r in pr],
                     color=["tab:green" if r["hit_rate"] > 0.5 else "tab:red" for r in pr])
        axes[2].invert_yaxis()
        for i, r in enumerate(pr):
            axes[2].text(r["ttft"]["p50"], i, f" hit {r['hit_rate']:.0%}", va="center")
        axes[2].set_xlabel("median TTFT (s)")
        axes[2].set_title("prefix caching")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
