"""The serving workload run through each engine: minfer's continuous batching, its static batches, one
request at a time, and transformers' `generate` on left-padded static batches.

Every run is greedy with EOS ignored, checks that each request generated exactly the tokens the workload
asked for, and returns one row of `minfer.lab.bench.serving_stats.summarize`, with the KV memory it held.
"""
from __future__ import annotations

import dataclasses
import gc
import time
import warnings
from typing import Optional, Sequence

import torch

from minfer.lab.bench.common import StepClock, synchronize
from minfer.lab.bench.serving_stats import request_rows, summarize
from minfer.lab.bench.serving_workload import Request


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


def greedy_params(max_tokens: int):
    """Greedy sampling of exactly `max_tokens` tokens (EOS ignored), so that every engine does the same work."""
    from minfer.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _check_lengths(outputs, workload: Sequence[Request], engine: str) -> None:
    got = [o.metrics.num_output_tokens for o in outputs]
    want = [r.max_tokens for r in workload]
    if got != want:
        raise RuntimeError(f"{engine}: generated {got[:8]}... tokens, the workload asked for {want[:8]}...")


def warm_up(llm, workload: Sequence[Request]) -> None:
    """A short untimed run, so the first timed one does not pay for allocator and kernel warm-up."""
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload[:4]], greedy_params(4), use_tqdm=False)


def run_minfer(llm, workload: Sequence[Request], batching: str = "continuous", max_num_seqs: int = 32,
               enable_prefix_caching: bool = True, name: Optional[str] = None) -> dict:
    """Every request handed to `llm.generate` at once; continuous (the engine) or static batches."""
    engine = fresh_engine(llm, max_num_seqs, enable_prefix_caching)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, [greedy_params(r.max_tokens) for r in workload], use_tqdm=False,
                           batching=batching)
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
    return summarize(name, request_rows(outputs), wall, **extra)


def run_sequential(llm, workload: Sequence[Request]) -> dict:
    """One request at a time through the engine: each waits for the previous one to finish.

    TTFT here counts from each request's own submission (no queueing behind the others)."""
    fresh_engine(llm, 1)
    rows, start = [], time.perf_counter()
    for r in workload:
        (out,) = llm.generate([{"prompt_token_ids": r.prompt_token_ids}], greedy_params(r.max_tokens), use_tqdm=False)
        _check_lengths([out], [r], "sequential")
        rows += request_rows([out])
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
    rows = []
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
                for r in batch:
                    n = r.max_tokens
                    rows.append({"ttft": clock.times[0] - start, "num_output_tokens": n,
                                 "tpot": (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None})
            wall = time.perf_counter() - start
    finally:
        config.eos_token_id, config.pad_token_id = saved
    return summarize("transformers generate (padded batches)", rows, wall, max_num_seqs=batch_size)
