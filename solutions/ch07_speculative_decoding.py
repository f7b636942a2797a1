"""Chapter 07: speculative decoding (worked solutions)."""
from __future__ import annotations

from typing import Optional

import torch


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to resample from after a rejection: normalize(max(0, p - q)).

    p, q: [vocab] probabilities (the target's and the draft's at one position). If p - q has no
    positive entry (p == q, so a rejection could not have happened), return p itself.
    """
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return p if total <= 0 else residual / total


def verify_drafts(draft_tokens: list[int], q: Optional[torch.Tensor], p: torch.Tensor, uniforms: list[float],
                  generator: Optional[torch.Generator] = None) -> list[int]:
    """Speculative sampling: which tokens a verification pass emits.

    draft_tokens: the k guesses. q: [k, vocab], the draft distribution each guess was drawn from,
    or None for deterministic guesses (then q is one-hot on each guess). p: [k + 1, vocab], the
    target's distributions at the k guessed positions and one beyond. uniforms: k numbers in
    [0, 1), one per guess. Going left to right, guess i is accepted when
    uniforms[i] < p[i, x] / q[i, x] (x the guess). At the first rejection, emit one token drawn
    with torch.multinomial(residual_distribution(p[i], q[i]), 1, generator=generator) and stop.
    If all k are accepted, emit a bonus token drawn the same way from p[k].
    Returns the accepted guesses followed by that one extra token (1 to k + 1 tokens).
    """
    for i, x in enumerate(draft_tokens):
        q_i = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).to(p)
        if uniforms[i] * q_i[x] < p[i, x]:  # u < p/q, written without dividing
            continue
        return list(draft_tokens[:i]) + [int(torch.multinomial(residual_distribution(p[i], q_i), 1, generator=generator))]
    return list(draft_tokens) + [int(torch.multinomial(p[len(draft_tokens)], 1, generator=generator))]


def greedy_verify(draft_tokens: list[int], target_logits: torch.Tensor) -> list[int]:
    """Greedy speculative decoding: target_logits [k + 1, vocab].

    Accept guesses while each equals the target's argmax at its position; then emit the target's
    argmax at the first position that disagreed (or at position k if all agreed).
    """
    best = target_logits.argmax(dim=-1).tolist()
    i = 0
    while i < len(draft_tokens) and draft_tokens[i] == best[i]:
        i += 1
    return list(draft_tokens[:i]) + [best[i]]


def ngram_propose(token_ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Prompt lookup: for n = max_n down to min_n, find the latest earlier occurrence of the last
    n tokens (an occurrence that ends before the last token) and return up to k tokens that
    followed it. The first n with a match wins; [] if none matches.
    """
    for n in range(max_n, min_n - 1, -1):
        if n >= len(token_ids):
            continue
        pattern = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start:start + n] == pattern:
                return token_ids[start + n:start + n + k]
    return []


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """The speedup to expect from speculative decoding over plain decoding.

    Each pass drafts k guesses, then the target checks them all in one forward pass. Guesses are
    checked in order; each is accepted with probability alpha given that the ones before it were,
    and the first rejection ends the pass. Either way the target adds one token of its own (the
    replacement of the rejected guess, or the bonus token when all k were accepted).

    alpha: the per-token acceptance probability, in [0, 1] (1 included); k: guesses per pass, an
    int >= 1; c: the cost of one draft step, in target steps (0 for free guesses). Count the
    verification pass as one plain target step.
    Returns the expected number of tokens per target step's worth of time, relative to plain
    decoding's one token per step (a plain number: 1.0 gains nothing, below 1.0 loses).

    Worked: (1 - alpha^(k+1)) / ((1 - alpha)(1 + k c)); alpha = 1 gives (k + 1) / (1 + k c).
    """
    tokens = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (1 + k * c)


def estimate_alpha(num_drafted: list[int], num_accepted: list[int]) -> float:
    """The per-token acceptance alpha of the expected-tokens formula, from verification passes.

    Pass i checked num_drafted[i] draft tokens and accepted the first num_accepted[i] of them.
    Model a pass as one Bernoulli(alpha) trial per draft token, in order, stopping at the first
    rejection or at the end of the draft (a pass that accepted all its drafts saw no rejection).
    Return the alpha that maximizes the probability of all the observed passes; 0.0 when they hold
    no trial. Raise ValueError when the two lists differ in length or some num_accepted[i] is not
    an integer in [0, num_drafted[i]].
    """
    if len(num_drafted) != len(num_accepted):
        raise ValueError(f"num_drafted and num_accepted must have one entry per pass, got {len(num_drafted)} and "
                         f"{len(num_accepted)}")
    accepted = rejections = 0
    for i, (drafted, kept) in enumerate(zip(num_drafted, num_accepted)):
        if not isinstance(kept, int) or not 0 <= kept <= drafted:
            raise ValueError(f"pass {i}: num_accepted must be an integer in [0, num_drafted] = [0, {drafted}], got {kept!r}")
        accepted += kept
        rejections += kept < drafted
    # the passes' probability is alpha^accepted (1 - alpha)^rejections: its maximum is at
    # accepted / (accepted + rejections)
    trials = accepted + rejections
    return accepted / trials if trials else 0.0
