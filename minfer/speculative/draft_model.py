"""A draft model: a small LM with the target's vocabulary guesses k tokens, one at a time.

Each sequence gets its own small contiguous KV cache for the draft (this file's choice: simpler
than giving the draft a paged pool of its own, and the draft's cache is tiny). The cache
remembers which tokens it holds. Before each proposal it keeps the longest prefix that still
agrees with the sequence (the target may have rejected some of the draft's guesses: rolling
back is just moving the cache's length back) and feeds the draft whatever is new: the whole
prompt the first time, afterwards the one to k+1 tokens the last verification emitted.

The draft samples with the request's own settings (temperature, top-k, top-p, min-p) and its
own generator, and returns the processed distributions it sampled from: the verifier needs
q(x) for min(1, p(x)/q(x)). In greedy mode it takes the argmax and returns no distribution.

A draft may have a reduced output head over the K most frequent tokens (`head_token_ids`, a
LongTensor [K] of target token ids): its logits are scattered into the full vocabulary with
-inf elsewhere, so it simply never proposes the other tokens. Acceptance stays exact.

Sequences are drafted one after another (batch 1 each); batching the draft across sequences
would need padding or a paged pool, and the engine's main use for a draft is low batch sizes.
"""
from __future__ import annotations

import weakref

import torch

from minfer.kv_cache import KVCache
from minfer.layers.sampler import draw
from minfer.models.llama import LlamaModel
from minfer.sequence import Sequence
from minfer.speculative.proposer import Proposal, Proposer
from minfer.speculative.rejection import processed_probs


class DraftModelProposer(Proposer):
    def __init__(self, model: LlamaModel, vocab_size: int) -> None:
        """vocab_size: the target's (the size of the distributions handed to the verifier)."""
        self.model, self.vocab_size = model, vocab_size
        self.head_token_ids = getattr(model, "head_token_ids", None)
        self.state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> (KVCache, token ids it holds)

    def release(self, seq: Sequence) -> None:
        self.state.pop(seq, None)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [self._propose_one(seq, k) for seq, k in zip(seqs, num_tokens)]

    def _propose_one(self, seq: Sequence, k: int) -> Proposal:
        if k == 0:
            return [], None
        if seq not in self.state:
            weight = self.model.embed_tokens.weight
            max_len = len(seq.prompt_token_ids) + seq.max_tokens  # drafts never reach past the last position
            self.state[seq] = (KVCache(self.model.config, 1, max_len, weight.dtype, weight.device), [])
        cache, held = self.state[seq]
        tokens = seq.token_ids
        limit = min(len(held), len(tokens) - 1)  # feed at least one token: we need its logits
        # the draft's cache and the sequence differ at most in the last few tokens (rejected drafts):
        # compare the rest in one go (in C), and walk token by token only over the end
        walk_from = max(0, limit - 16)
        common = walk_from if held[:walk_from] == tokens[:walk_from] else 0
        while common < limit and held[common] == tokens[common]:
            common += 1
        cache.length = common  # roll back: what lies beyond will be overwritten
        del held[common:]
        device = self.model.embed_tokens.weight.device
        feed = torch.tensor(tokens[common:], device=device)
        drafts, probs = [], []
        # The drafts stay on the device until the pass ends: one transfer to the host per pass, not one
        # per token, so that a GPU never waits for the host between the draft's k forward passes.
        for i in range(k):
            logits = self._forward(cache, feed)
            if seq.params.greedy:
                token = logits.argmax(dim=-1, keepdim=True)
            else:
                q = processed_probs(logits[None], seq.params)[0]
                token = draw(q[None], torch.rand(1, generator=seq.generator).to(device))
                probs.append(q)
            drafts.append(token)
            feed = token  # the last draft is never fed: its KV is only needed once it is accepted
        draft_ids = torch.cat(drafts).tolist()
        held.extend(tokens[common:] + draft_ids[:-1])
        return draft_ids, (torch.stack(probs) if probs else None)

    def _forward(self, cache: KVCache, feed: torch.Tensor) -> torch.Tensor:
        """Run the new tokens [n] through the draft; the logits [vocab] after the last one."""
        positions = torch.arange(cache.length, cache.length + len(feed), device=feed.device)
        logits = self.model(feed[None], positions[None], kv_cache=cache)[0, -1]
        if self.head_token_ids is None:
            return logits
        full = logits.new_full((self.vocab_size,), float("-inf"))
        full[self.head_token_ids.to(feed.device)] = logits
        return full
