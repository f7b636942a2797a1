"""From logits to the next token: greedy, temperature, top-k, top-p, min-p, per-request seeds."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from minfer.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Scale one row of logits [vocab] by temperature and set the tokens we may not pick to -inf.

    In vLLM's order: temperature, min-p, then top-k and top-p (so top-p counts the mass min-p left)."""
    logits = logits / temperature
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth_value = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_value, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already cover top_p (the top one always stays)
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample_from(weights: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """One token per row of weights [rows, vocab] (probabilities, or any non-negative weights, on
    the CPU), row i drawn with generators[i].

    Inverse transform sampling: one uniform number per row, looked up in the row's running sum.
    torch.multinomial costs as much as drawing a random number for every token of the vocabulary:
    1.3 ms a row for SmolLM2's 49,152 tokens on one CPU core, about what a whole decode step of a
    small model takes on a GPU. This costs a cumulative sum, 0.07 ms a row
    (benchmarks/bench_step_overhead.py). In float32, a token's probability is off by at most half
    a rounding step of the running sum (3e-8)."""
    cdf = weights.float().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    uniforms = torch.cat([torch.rand(1, generator=g) for g in generators])
    tokens = torch.searchsorted(cdf, (uniforms[:, None] * total).contiguous(), right=True)
    # rounding may put u * total at the very end: then the last token with any weight
    return torch.minimum(tokens, torch.searchsorted(cdf, total)).view(-1).tolist()


def sample_next_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                       generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """logits [batch, vocab] float32 -> one token id per row, each row with its own settings.

    Each row draws from its own generator, so a seeded request gets the same tokens whatever
    else shares the batch.
    """
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    probs = torch.stack([torch.softmax(filter_logits(logits[row], params[row].temperature, params[row].top_k,
                                                     params[row].top_p, params[row].min_p), dim=-1) for row in sampled])
    # The draws use CPU generators (a seed gives the same tokens on any device): the sampled rows'
    # probabilities come over in one copy (each copy from a GPU waits for it).
    drawn = sample_from(probs.cpu(), [generators[row] for row in sampled])
    for row, token in zip(sampled, drawn):
        tokens[row] = token
    return tokens
