"""N-gram prompt lookup: a draft model that costs nothing.

When a model edits, quotes or summarises a text it was given, its output repeats long runs of
that text. So take the last n tokens generated, find where they occurred earlier (in the prompt
or the output), and guess that what followed them then follows them now. Try long n-grams
first (a match on 4 tokens is better evidence than a match on 1). The guess is deterministic,
so its "draft distribution" is one-hot and the target accepts it with probability
p_target(guess) (always, in greedy mode, when the guess is the target's argmax).

vLLM calls this `speculative_model="[ngram]"` with prompt_lookup_max / prompt_lookup_min.
"""
from __future__ import annotations

from minfer.config import check_prompt_lookup
from minfer.sequence import Sequence
from minfer.speculative.proposer import Proposal, Proposer


def ngram_lookup(token_ids: list[int], num_tokens: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier occurrence of the last n tokens,
    for the longest n in [min_n, max_n] that has one; [] if none does."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = token_ids[length - n:]
        last = pattern[-1]
        # the latest start first; the match must leave at least one token after it
        for start in range(length - n - 1, -1, -1):
            if token_ids[start + n - 1] == last and token_ids[start:start + n] == pattern:
                return token_ids[start + n:start + n + num_tokens]
    return []


class NgramProposer(Proposer):
    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        check_prompt_lookup(prompt_lookup_max, prompt_lookup_min)
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [(ngram_lookup(s.token_ids, k, self.max_n, self.min_n), None) for s, k in zip(seqs, num_tokens)]
