"""The EAGLE proposer: an `EagleHead` guesses k tokens from the target's own features.

The engine hands the proposer the target's pre-norm hidden states of every pass (`observe`: prefill
chunks, plain decode steps and verification passes). The proposer copies them into a per-sequence
buffer indexed by position. A verification pass also computes features at drafts the target went on
to reject; they are simply overwritten by the next pass, which starts at the first rejected position.
So when a sequence of n+1 tokens is ready to draft, the features at positions 0..n-1 are the
target's, all computed from accepted tokens.

The head keeps its own one-layer KV cache per sequence. Its row t reads (f_t, token t+1). Before each
proposal it runs the rows that became final since the last one (the whole prompt the first time,
afterwards the one to k+1 positions the last pass accepted); the last of them predicts f_{n}, whose
logits give the first guess. Each further guess feeds the predicted feature and the guessed token
back as one more row; those rows are rolled back (the cache's length moved back) before the next
proposal, because the target's real features replace them.

A prompt served from the prefix cache is not computed, so its features never arrive: the head then
starts at the first position the target did compute (it guesses with less context, losslessly).
Preemption recomputes a sequence: its features are rewritten, the head's rows stay valid (the tokens
did not change). Sampling follows the draft model's rules (`draft_model.py`): the request's own
settings, its generator, and the distribution q handed to the verifier; greedy returns no q.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from minfer.kv_cache import KVCache
from minfer.layers.sampler import draw
from minfer.sequence import Sequence
from minfer.speculative.eagle_head import EagleHead
from minfer.speculative.proposer import Proposal, Proposer
from minfer.speculative.rejection import processed_probs


@dataclass
class EagleState:
    """One sequence's features and the head's cache over them."""

    features: torch.Tensor  # [positions, hidden]: the target's feature at each computed position
    start: int  # the first position whose feature arrived (later than 0 after a prefix-cache hit)
    cache: KVCache  # the head's rows for positions start, start+1, ...
    rows: int = 0  # rows in the cache built from the target's features (the rest were guesses)


class EagleProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, head: EagleHead, vocab_size: int) -> None:
        """vocab_size: the target's (the size of the distributions handed to the verifier)."""
        self.head, self.vocab_size = head, vocab_size
        self.feature_layers = head.feature_layers
        self.state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> EagleState

    def release(self, seq: Sequence) -> None:
        self.state.pop(seq, None)

    @torch.inference_mode()
    def observe(self, seq: Sequence, first_position: int, hidden: torch.Tensor) -> None:
        hidden = self.head.read_features(hidden)  # EAGLE-3: several layers' outputs mixed into one feature
        state = self.state.get(seq)
        if state is None:
            length = len(seq.prompt_token_ids) + seq.max_tokens + 1  # every position a pass can reach
            weight = self.head.fc.weight
            state = EagleState(torch.zeros(length, hidden.shape[-1], dtype=weight.dtype, device=weight.device),
                               first_position, KVCache(self.head.config, 1, length, weight.dtype, weight.device))
            self.state[seq] = state
        skip = max(0, state.start - first_position)  # positions before the head's first row are not needed
        end = first_position + len(hidden)
        state.features[first_position + skip:end] = hidden[skip:]

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [self._propose_one(seq, k) for seq, k in zip(seqs, num_tokens)]

    @torch.inference_mode()
    def _propose_one(self, seq: Sequence, k: int) -> Proposal:
        state, newest = self.state.get(seq), seq.num_tokens - 1  # the newest token's feature is not known yet
        first = None if state is None else state.start + state.rows
        if k == 0 or first is None or first >= newest:  # no features: this step decodes the ordinary way
            return [], None
        head, device = self.head, self.head.fc.weight.device
        state.cache.length = state.rows  # forget the guessed rows of the last proposal
        features = state.features[first:newest][None]
        ids = torch.tensor(seq.token_ids[first + 1:newest + 1], device=device)[None]
        positions = torch.arange(first - state.start, newest - state.start, device=device)[None]
        drafts, probs = [], []
        # the drafts stay on the device until the pass ends: one transfer to the host per proposal
        for i in range(k):
            predicted = head(features, ids, positions, state.cache)[:, -1:]
            if i == 0:
                state.rows = newest - state.start  # the rows just run are final (the target's features)
            logits = head.logits(predicted)[0, 0]
            if seq.params.greedy:
                token = head.head_token_ids[logits.argmax()].view(1)
            else:
                full = logits.new_full((self.vocab_size,), float("-inf"))
                full[head.head_token_ids] = logits
                q = processed_probs(full[None], seq.params)[0]
                token = draw(q[None], torch.rand(1, generator=seq.generator).to(device))
                probs.append(q)
            drafts.append(token)
            features, ids, positions = predicted, token[None], positions[:, -1:] + 1
        return torch.cat(drafts).tolist(), (torch.stack(probs) if probs else None)
