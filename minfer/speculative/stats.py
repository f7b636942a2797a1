"""What speculation bought: vLLM's speculative-decoding metrics, and the per-token alpha of the theory.

vLLM's metrics, under vLLM's names:
    draft_acceptance_rate = accepted draft tokens / proposed draft tokens.
    mean_acceptance_length = tokens emitted per verification pass = 1 + accepted / drafts
        (the 1 is the correction or bonus token every pass yields).
    acceptance_rate_per_position[i] = how often the draft token at position i was accepted, among
        the drafts that had a position i.

The expected-tokens formula E = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al., 2023) needs another
quantity: alpha, the chance that a draft token is accepted *given that every draft token before it
was*. A token at position i is only accepted if all before it were, so draft_acceptance_rate mixes
alpha with the draft length: for a steady alpha it is alpha (1 - alpha^k) / ((1 - alpha) k), which
falls as k grows. Two estimators of alpha:

* `SpecDecodeStats.alpha` (from the counts, any draft lengths): each verification pass is a run of
  Bernoulli(alpha) trials that stops at the first rejection or at the end of the draft. All passes
  together have likelihood alpha^A (1 - alpha)^R, with A the accepted draft tokens and R the
  rejections (passes that stopped before their draft ran out), so the maximum-likelihood estimate
  is A / (A + R). A draft cut short (lookup found fewer tokens, max_tokens was near) is simply a
  run that ended without a rejection: no bias.
* `alpha_from_mean_acceptance_length(L, k)` (when only vLLM's mean acceptance length is known, for a
  fixed k): the alpha whose E equals L, found by bisection (E grows with alpha).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification passes that checked at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rejections: int = 0  # passes that stopped at a rejected draft token (not at the draft's end)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0  # time spent proposing (draft forwards or n-gram lookups)

    def copy(self) -> SpecDecodeStats:
        """A copy that later counts do not change (an engine snapshot's; cheaper than copy.deepcopy)."""
        return replace(self, num_draft_tokens_per_pos=list(self.num_draft_tokens_per_pos),
                       num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        grow = num_draft - len(self.num_draft_tokens_per_pos)
        if grow > 0:
            self.num_draft_tokens_per_pos += [0] * grow
            self.num_accepted_tokens_per_pos += [0] * grow
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_rejections += num_accepted < num_draft
        for i in range(num_draft):
            self.num_draft_tokens_per_pos[i] += 1
            self.num_accepted_tokens_per_pos[i] += i < num_accepted

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    @property
    def alpha(self) -> float:
        """Per-token acceptance given the earlier drafts accepted (the alpha of the expected-tokens
        formula), maximum-likelihood: accepted / (accepted + rejections); 0.0 before any draft."""
        trials = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / trials if trials else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "draft_acceptance_rate": self.draft_acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_rate_per_position": self.acceptance_rate_per_position, "num_rejections": self.num_rejections,
                "alpha": self.alpha, "draft_time_s": self.draft_time_s}


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha): the expected accepted drafts of a
    pass with k draft tokens, each accepted with probability alpha given the ones before it, plus
    the one token every pass yields."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a probability in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"k (draft tokens per pass) must be an integer >= 0, got {k!r}")
    return float(sum(alpha ** i for i in range(k + 1)))  # the sum, not the quotient: exact at alpha = 1


def alpha_from_mean_acceptance_length(mean_acceptance_length: float, k: int) -> float:
    """The alpha whose expected tokens per pass, with k draft tokens, equal the measured mean
    acceptance length (vLLM's metric), found by bisection: E grows strictly with alpha for k >= 1.
    Meant for runs whose passes all drafted k tokens; `SpecDecodeStats.alpha` needs no such care."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k (draft tokens per pass) must be an integer >= 1, got {k!r}")
    if not 1 <= mean_acceptance_length <= k + 1:  # also refuses NaN
        raise ValueError(f"mean_acceptance_length must lie in [1, k + 1] = [1, {k + 1}], got {mean_acceptance_length!r}")
    low, high = 0.0, 1.0
    for _ in range(60):  # 2^-60: below float precision
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_pass(mid, k) < mean_acceptance_length else (low, mid)
    return (low + high) / 2
