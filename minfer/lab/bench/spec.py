"""Measuring speculative decoding: the expected-speedup formula and the timings to set beside it.

One speculative step costs one draft step per draft token (c each, in units of a target step)
plus one target pass over k+1 positions (v target steps), and yields on average
E = (1 - alpha^(k+1)) / (1 - alpha) tokens when each draft token is accepted with probability
alpha given that the ones before it were (`SpecDecodeStats.alpha`, not vLLM's
draft_acceptance_rate). Hence

    expected speedup = (1 - alpha^(k+1)) / ((1 - alpha) (v + k c))

Leviathan et al. (2023) take v = 1: scoring k+1 positions costs the same as scoring one, true while
a step is bound by reading the weights. `forward_cost` measures v here (a pass over k+1 positions
over a pass over one; `verify_costs`). The benchmark (benchmarks/bench_speculative.py) and notebook 07 time with
these helpers; `cost_ratio` also gives the router's c (benchmarks/bench_router.py, notebook 08).
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from minfer.lab.bench.common import synchronize
from minfer.kv_cache import KVCache
from minfer.models.llama import LlamaModel
from minfer.sampling_params import SamplingParams
from minfer.speculative.proposer import Proposer
from minfer.speculative.stats import SpecDecodeStats, expected_tokens_per_pass

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # "cpu": for a CPU device, see decode_rate


def expected_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Expected tokens per pass over the pass's cost in target steps: k draft steps of c each, and
    one verification pass of `verify_cost` steps (1: the formula's assumption; see `forward_cost`)."""
    if not c >= 0 or not verify_cost > 0:  # refuses NaN too
        raise ValueError(f"the costs must be c >= 0 and verify_cost > 0, got c={c!r}, verify_cost={verify_cost!r}")
    return expected_tokens_per_pass(alpha, k) / (verify_cost + k * c)


@torch.inference_mode()
def forward_costs(model: LlamaModel, context_len: int, token_counts: list[int], repeats: int = 10,
                  clock: str = "wall") -> list[float]:
    """Median seconds of a batch-1 forward pass over each of token_counts new tokens after
    context_len cached ones. The counts take turns, repeat after repeat, so that a change in the
    machine's load hits them all alike. clock: "wall", or "cpu" (this process's CPU time; see
    `decode_rate`)."""
    now = CLOCKS[clock]
    weight = model.embed_tokens.weight
    longest = max(token_counts)
    cache = KVCache(model.config, 1, context_len + longest, weight.dtype, weight.device)
    ids = torch.randint(0, model.config.vocab_size, (1, context_len + longest), device=weight.device)
    model(ids[:, :context_len], torch.arange(context_len, device=weight.device)[None], cache)
    times: list[list[float]] = [[] for _ in token_counts]
    for _ in range(repeats + 1):  # the first round is a warm-up
        for i, n in enumerate(token_counts):
            cache.length = context_len
            positions = torch.arange(context_len, context_len + n, device=weight.device)[None]
            start = now()
            model(ids[:, context_len:context_len + n], positions, cache)
            synchronize(weight.device)
            times[i].append(now() - start)
    return [statistics.median(t[1:]) for t in times]


def forward_cost(model: LlamaModel, context_len: int, num_tokens: int = 1, repeats: int = 10,
                 clock: str = "wall") -> float:
    """Median seconds of one batch-1 forward pass over num_tokens new tokens after context_len cached ones."""
    return forward_costs(model, context_len, [num_tokens], repeats, clock)[0]


def verify_costs(model: LlamaModel, ks: list[int], context_len: int = 256, repeats: int = 10,
                 clock: str = "wall") -> dict[int, float]:
    """v for each k: a batch-1 pass over k+1 new positions / a pass over one, timed side by side."""
    costs = forward_costs(model, context_len, [1] + [k + 1 for k in ks], repeats, clock)
    return {k: cost / costs[0] for k, cost in zip(ks, costs[1:])}


def cost_ratio(draft: LlamaModel, target: LlamaModel, context_len: int = 256, repeats: int = 10,
               clock: str = "wall") -> float:
    """c = one draft decode step / one target decode step, at batch 1."""
    return (forward_cost(draft, context_len, 1, repeats, clock) /
            forward_cost(target, context_len, 1, repeats, clock))


def decode_rate(llm, prompts: list, max_tokens: int, proposer: Optional[Proposer] = None, k: int = 0,
                clock: str = "wall") -> dict:
    """Greedy-generate each prompt alone (batch 1) with `proposer` and k draft tokens (None: plain
    decoding) on llm's engine. Returns decode tokens/s (after the first token, which prefill
    makes), the speculative metrics and the output ids. The engine's settings are restored after.

    clock "wall": the decode phase's wall time, from the requests' own timestamps. clock "cpu"
    (CPU device, one thread): this process's CPU time for the whole request minus that of the same
    prompt's prefill alone (a 1-token request). On a shared machine wall time also counts other
    programs' turns on the core; CPU time does not, and for one thread without I/O it is what the
    wall time would be on an idle machine."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    engine = llm.engine
    saved = engine.proposer, engine.num_speculative_tokens, engine.spec_stats, engine.blocks.enable_prefix_caching
    engine.proposer, engine.num_speculative_tokens, engine.spec_stats = proposer, k, SpecDecodeStats()
    engine.blocks.enable_prefix_caching = False  # every run computes its prompt: no help from earlier runs
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    cpu_seconds = 0.0
    try:
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        engine.spec_stats = SpecDecodeStats()
        outputs = []
        for prompt in prompts:
            if clock == "cpu":  # the prefill alone: a 1-token request drafts nothing
                start = time.process_time()
                llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
                cpu_seconds -= time.process_time() - start
            start = time.process_time()
            outputs.append(llm.generate(prompt, params, use_tqdm=False)[0])
            cpu_seconds += time.process_time() - start
        stats = engine.spec_stats
    finally:
        engine.proposer, engine.num_speculative_tokens, engine.spec_stats, engine.blocks.enable_prefix_caching = saved
    tokens = sum(o.metrics.num_output_tokens - 1 for o in outputs)
    seconds = (cpu_seconds if clock == "cpu" else
               sum(o.metrics.finished_time - o.metrics.first_token_time for o in outputs))
    return {"tokens_per_s": tokens / seconds, "decode_tokens": tokens, "seconds": seconds, "clock": clock,
            "spec": stats.as_dict(), "token_ids": [o.outputs[0].token_ids for o in outputs]}


def grounded_prompts(llm, n: int, chars: int = 700) -> list[dict]:
    """Input-grounded tasks on pydoc passages: the answer copies much of its input (lookup's home ground).
    Chat prompts as token ids (`LLM.chat_prompt`)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    names = ["assert", "pass", "del", "return", "break", "continue", "global", "import"][:n]
    tasks = ["Repeat the following text exactly, word for word:", "Fix the typos in this text and return all of it:",
             "Rewrite this documentation in the same words, as plain text:"]
    prompts = []
    for i, name in enumerate(names):
        text = topics[name][:chars]
        if "typos" in tasks[i % len(tasks)]:  # a few made-up typos to fix: swap two letters every ~60 chars
            chars_ = list(text)
            for j in range(30, len(chars_) - 1, 60):
                if chars_[j].isalpha() and chars_[j + 1].isalpha():
                    chars_[j], chars_[j + 1] = chars_[j + 1], chars_[j]
            text = "".join(chars_)
        prompts.append(llm.chat_prompt([{"role": "user", "content": f"{tasks[i % len(tasks)]}\n\n{text}"}]))
    return prompts


CHAT_QUESTIONS = ["Write a short story about a robot who learns to paint.", "What are the benefits of regular exercise?",
                  "Explain how rainbows form.", "Give me three tips for learning a new language.",
                  "Describe a perfect weekend in the mountains.", "Why is the sky blue?"]


def chat_prompts(llm, n: int) -> list[dict]:
    """Open chat: nothing to copy from, so only a draft model can guess (prompts as token ids)."""
    return [llm.chat_prompt([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS[:n]]
