"""Verification: keep the draft tokens the target agrees with, and stay exactly lossless.

The target has scored all k draft tokens (and one position beyond) in a single forward pass,
so for every position i we have p_i, the target's distribution there, and q_i, the draft's
distribution the guess x_i was drawn from (one-hot for a deterministic guess). Going left to
right:

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
    at the first rejection, emit a token from normalize(max(0, p_i - q_i)) and stop;
    if all k are accepted, emit a bonus token from p_k (the pass computed it anyway).

Why the emitted token is distributed exactly as p_i: it is x and accepted with probability
q(x) min(1, p(x)/q(x)) = min(p(x), q(x)); a rejection happens with probability
1 - sum_x min(p(x), q(x)) = sum_x max(0, p(x) - q(x)), and then x comes out with probability
max(0, p(x) - q(x)) / that sum. Together: min(p, q) + max(0, p - q) = p(x). The draft only
changes how many tokens a pass yields, never which tokens are likely.

Greedy decoding is the limit where p is one-hot on the target's argmax: accept while the
guess equals the argmax; the first disagreement is replaced by the argmax.

p and q are the *processed* distributions (temperature, top-k, top-p, min-p applied), so the
output follows exactly what the request asked of the target.
"""
from __future__ import annotations

from typing import Optional

import torch

from minfer.layers.sampler import filter_logits, sample_from
from minfer.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [rows, vocab] -> the distributions the request samples from, [rows, vocab] float32."""
    rows = [filter_logits(row, params.temperature, params.top_k, params.top_p, params.min_p) for row in logits.float()]
    return torch.softmax(torch.stack(rows), dim=-1)


def rejection_sample(draft_tokens: list[int], draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                     generator: Optional[torch.Generator] = None) -> list[int]:
    """draft_tokens [k], draft_probs [k, vocab] (None: one-hot guesses), target_probs [k + 1, vocab]
    -> the emitted tokens: the accepted drafts, then one token from the residual or the bonus position."""
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.nn.functional.one_hot(torch.tensor(token), p.shape[-1]).to(p)
        if torch.rand((), generator=generator) * q[token] < p[token]:  # u < p/q, without dividing by q
            continue
        residual = (p - q).clamp(min=0)
        if residual.sum() <= 0:  # p == q up to rounding: the rejection had probability ~0; p is the right law
            residual = p
        return draft_tokens[:i] + sample_from(residual[None], [generator])
    return list(draft_tokens) + sample_from(target_probs[len(draft_tokens)][None], [generator])


def greedy_verify(draft_tokens: list[int], target_logits: torch.Tensor) -> list[int]:
    """Accept the drafts while they equal the target's argmax, then emit the target's own choice."""
    best = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == best[accepted]:
        accepted += 1
    return list(draft_tokens[:accepted]) + [best[accepted]]


def verify(draft_tokens: list[int], draft_probs: Optional[torch.Tensor], target_logits: torch.Tensor,
           params: SamplingParams, generator: Optional[torch.Generator] = None) -> list[int]:
    """target_logits [k + 1, vocab] (raw) at the positions of the last known token and the k drafts
    -> the tokens to emit (1 to k + 1), drawn with the sequence's own generator."""
    if params.greedy:
        return greedy_verify(draft_tokens, target_logits)
    if draft_probs is not None:
        draft_probs = draft_probs[:len(draft_tokens)].cpu()  # the scheduler may have cut the draft short
    return rejection_sample(draft_tokens, draft_probs, processed_probs(target_logits.cpu(), params), generator)
