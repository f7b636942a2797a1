"""The proposer interface: whatever guesses the next few tokens for the target to check.

A proposer looks at each sequence's tokens so far and returns up to k guesses per sequence,
with the probabilities it drew them from (None when it is deterministic: n-gram lookup, or a
draft model decoding greedily). The verifier (`minfer.speculative.rejection`) treats None as a
one-hot distribution on the guessed token, which is exactly what a deterministic guess is.
"""
from __future__ import annotations

from typing import Optional

import torch

from minfer.sequence import Sequence

# (draft token ids, their draft distributions [len(tokens), vocab] or None for one-hot guesses)
Proposal = tuple[list[int], Optional[torch.Tensor]]


class Proposer:
    """Base class: subclasses implement `propose`. A proposer may return fewer tokens than asked
    (even none: the sequence then decodes one token the ordinary way)."""

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        """Up to num_tokens[i] draft tokens for seqs[i], one Proposal per sequence."""
        raise NotImplementedError

    # True: the engine hands `observe` the target's pre-norm hidden states of every pass (an EAGLE head's input)
    needs_hidden_states: bool = False
    # with it: earlier decoder layers whose outputs come first in each row handed to `observe` (EAGLE-3's features)
    feature_layers: tuple[int, ...] = ()

    def observe(self, seq: Sequence, first_position: int, hidden: torch.Tensor) -> None:
        """The target just computed hidden [n, (len(feature_layers) + 1) x hidden_size] for seq's positions
        first_position.. (prefill chunks, decode steps and verification passes, rejected drafts included)."""

    def release(self, seq: Sequence) -> None:
        """The sequence is done: forget any state kept for it (a draft model's KV cache)."""
