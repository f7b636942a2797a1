"""Mixture-of-experts measurements for benchmarks/bench_moe.py and chapter 10.

- expected_distinct_experts: E (1 - (1 - k/E)^B), the experts a batch of B tokens touches on average
  when each token picks k of E uniformly and independently;
- distinct_experts_per_step: what a carved model's decode steps really touch, per layer, at batch B;
- decode_tokens_per_s: decode speed at batch B (one thread's CPU time, as minfer.lab.bench.spec counts it);
- simulate_routing: a toy router (skewed logits, top-k, capacity) for the chapter's widget.
"""
from __future__ import annotations

import time
import torch

from minfer.lab.evaluate import EVAL_PROMPTS
from minfer.layers.moe import distinct_experts, route_topk, tokens_per_expert
from minfer.moe.carve import CarvedMoE
from minfer.lab.tiny_moe import capacity_mask, expert_capacity
from minfer.sampling_params import SamplingParams


def expected_distinct_experts(num_experts: int, top_k: int, batch_size: int) -> float:
    """Each expert is missed by one token with probability 1 - k/E, by all B with (1 - k/E)^B."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch_size)


def prompts_for_batch(batch_size: int) -> list[str]:
    """batch_size different prompts: the evaluation prompts, numbered when there are more requests than prompts."""
    return [EVAL_PROMPTS[i % len(EVAL_PROMPTS)] + ("" if i < len(EVAL_PROMPTS) else f" ({i})") for i in range(batch_size)]


def distinct_experts_per_step(llm, batch_size: int, max_tokens: int = 12) -> dict:
    """Decode batch_size prompts together (static batch: every step holds exactly batch_size tokens)
    and count the distinct experts each carved layer touches per decode step. Returns the mean over
    layers and steps, and the mean share of tokens that the busiest expert of a step took."""
    layers = [layer.mlp for layer in llm.model.layers if isinstance(layer.mlp, CarvedMoE)]
    if not layers:
        raise ValueError("the model has no carved experts: LLM(..., carve_experts=E, carve_top_k=k)")
    counts, busiest = [], []

    def record(module, args, output):
        ids = module.last_expert_ids
        if args[0].shape[-2] == 1 and len(ids) == batch_size:  # a decode step of the whole batch
            counts.append(distinct_experts(ids))
            busiest.append(tokens_per_expert(ids, module.num_experts).max().item() / batch_size)

    hooks = [mlp.register_forward_hook(record) for mlp in layers]
    try:
        llm.generate(prompts_for_batch(batch_size), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     use_tqdm=False, batching="static")
    finally:
        for hook in hooks:
            hook.remove()
    return {"batch_size": batch_size, "distinct": sum(counts) / len(counts), "busiest_share": sum(busiest) / len(busiest),
            "samples": len(counts)}


def decode_tokens_per_s(llm, batch_size: int, max_tokens: int = 32, repeats: int = 2) -> float:
    """Decode tokens/s at batch_size through the engine: the CPU time of max_tokens tokens minus that
    of one (the prefill), best of `repeats` (one torch thread: CPU time is what a quiet machine's wall
    time would be)."""
    prompts = prompts_for_batch(batch_size)
    saved = llm.engine.blocks.enable_prefix_caching
    llm.engine.blocks.enable_prefix_caching = False
    best = float("inf")
    try:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        for _ in range(repeats):
            cost = []
            for n in (1, max_tokens):
                start = time.process_time()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
                cost.append(time.process_time() - start)
            best = min(best, cost[1] - cost[0])
    finally:
        llm.engine.blocks.enable_prefix_caching = saved
    return batch_size * (max_tokens - 1) / best


def simulate_routing(num_experts: int, top_k: int, capacity_factor: float, num_tokens: int = 4096,
                     skew: float = 1.0, seed: int = 0) -> dict:
    """A toy router: logits = token noise + a fixed per-expert bias of spread `skew` (0: balanced
    on average; larger: some experts popular). Top-k routing, then a capacity of
    capacity_factor x the even share per expert. Returns each expert's share of assignments,
    the dropped share, and the capacity."""
    gen = torch.Generator().manual_seed(seed)
    bias = torch.randn(num_experts, generator=gen) * skew
    logits = torch.randn(num_tokens, num_experts, generator=gen) + bias
    _, ids = route_topk(logits, top_k, normalize=True)
    capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    kept = capacity_mask(ids, num_experts, capacity)
    load = tokens_per_expert(ids, num_experts).float() / ids.numel()
    return {"load": load.tolist(), "dropped": 1 - kept.float().mean().item(), "capacity_share": capacity / ids.numel()}

