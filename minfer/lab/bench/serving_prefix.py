"""The prefix-caching experiment: the same pieces of prompt arranged so that the cache can or cannot engage.

A shared system prompt with and without the cache, the shared part placed after the per-request part,
retrieved passages in a stable vs a shuffled order: prefill tokens computed, hit rate and median TTFT,
each on a warmed engine (the process's first, cold request is reported apart).
"""
from __future__ import annotations

import random
import time

from minfer.lab.bench.serving_engines import fresh_engine, greedy_params
from minfer.lab.bench.serving_stats import latency_stats, load_average
from minfer.lab.bench.serving_workload import corpus_text, text_tokens


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
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(max_tokens), use_tqdm=False)
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    decode_fed = sum(o.metrics.num_output_tokens - 1 for o in outputs)  # every output token but the last is fed back
    counts = engine.snapshot()
    prefill = counts.computed_tokens - decode_fed
    ttfts = [o.metrics.ttft for o in outputs]
    return {"case": name, "prefix_caching": enable_prefix_caching, "requests": len(prompts),
            "prompt_tokens": prompt_tokens, "prefill_tokens_computed": prefill, "hit_rate": counts.prefix_hit_rate,
            "ttft": latency_stats(ttfts), "ttfts": ttfts, "wall_s": wall, "load_1min_after": load_average(),
            "preemptions": counts.num_preemptions}


def run_prefix_experiment(llm, num_requests: int = 32, system_tokens: int = 512, max_tokens: int = 16,
                          passage_tokens: int = 128, num_passages: int = 4, max_num_seqs: int = 32, seed: int = 1) -> dict:
    """Every case of `prefix_scenarios` on a warmed engine, the cold first request, and what the cache saved."""
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
