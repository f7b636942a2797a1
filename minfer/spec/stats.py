"""What speculation bought: vLLM's speculative-decoding metrics.

draft_acceptance_rate = accepted draft tokens / proposed draft tokens (alpha, per token).
mean_acceptance_length = tokens emitted per verification pass = 1 + accepted / drafts
    (the 1 is the correction or bonus token every pass yields).
acceptance_rate_per_position[i] = how often the draft token at position i was accepted, among
    the drafts that had a position i (a token at i can only be accepted if all before it were,
    so the rates fall with i: roughly alpha^(i+1) for a steady alpha).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification passes that checked at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0  # time spent proposing (draft forwards or n-gram lookups)

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

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "draft_acceptance_rate": self.draft_acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_rate_per_position": self.acceptance_rate_per_position, "draft_time_s": self.draft_time_s}
