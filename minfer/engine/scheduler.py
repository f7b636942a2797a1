"""Continuous batching: which sequences run in the next step, and how many tokens each brings.

Every step the scheduler fills a token budget (max_num_batched_tokens):
  1. running sequences first, oldest first: one token each when decoding (1 + its draft tokens
     with speculative decoding, cut to fit the budget and the free blocks), the next chunk of the
     prompt while still prefilling (chunked prefill: a long prompt is eaten in pieces, so the
     others keep decoding meanwhile);
  2. then waiting sequences, first come first served, as long as the budget, the sequence limit
     (max_num_seqs) and free KV blocks allow. A request is admitted the moment there is room,
     not when the whole batch is done: that is the difference from static batching.
When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks go back to the pool and it returns to the front of the queue, to be
recomputed later (its tokens so far become its prompt). No out-of-memory crash, no lost work
beyond the recompute.
"""
from __future__ import annotations

from collections import deque

from minfer.engine.block_manager import BlockManager
from minfer.sequence import Sequence


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.admitted_prompt_tokens = 0  # prompt tokens of first admissions
        self.cached_prompt_tokens = 0  # of those, found in the prefix cache

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """A sequence leaves (finished or aborted): its blocks go back to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt the newest running sequence, `seq`."""
        self.running.pop()
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.spec_token_ids.clear()  # recomputed from scratch: it drafts again afterwards
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _fit_draft(self, seq: Sequence, budget: int) -> None:
        """Speculative decoding: a verification pass (last token + drafts) must run whole, and drafts
        are optional, so cut them to what the token budget and the free blocks allow instead of
        preempting anyone for them."""
        keep = max(0, min(len(seq.spec_token_ids), budget - 1))
        while keep and not self.blocks.can_append(seq.num_tokens + keep, seq.block_table):
            keep -= 1
        del seq.spec_token_ids[keep:]

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's batch: (sequence, number of new tokens to compute) pairs."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted: set[Sequence] = set()  # this step's victims: the newest running sequences
        for seq in list(self.running):
            if seq in preempted:  # preempted below to make room for an older one: so are all after it
                break
            if seq.num_pending and len(seq.output_ids) + seq.num_pending >= seq.max_tokens:
                continue  # its token in flight is its last (async scheduling): nothing more to compute
            if seq.spec_token_ids:
                self._fit_draft(seq, budget)
            todo = min(seq.num_tokens + seq.num_pending + len(seq.spec_token_ids) - seq.num_computed, budget)
            if todo <= 0:
                break
            while not self.blocks.can_append(seq.num_computed + todo, seq.block_table):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            if seq in preempted:
                break
            self.blocks.append(seq.block_table, seq.num_computed + todo)
            batch.append((seq, todo))
            budget -= todo
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.token_ids
            use_cache = not seq.needs_prompt_logits  # cached positions have no logits to score the prompt with
            cached = len(self.blocks.cached_prefix(tokens, use_cache)) * self.blocks.block_size
            todo = len(tokens) - cached
            if todo > budget and not self.enable_chunked_prefill:
                break
            if not self.blocks.can_allocate(tokens, use_cache):
                break
            self.waiting.popleft()
            seq.block_table, seq.num_computed = self.blocks.allocate(tokens, use_cache)
            if seq.num_preemptions == 0:  # a first admission, not a recompute
                seq.num_cached_prompt_tokens = seq.num_computed
                self.admitted_prompt_tokens += len(seq.prompt_token_ids)
                self.cached_prompt_tokens += seq.num_computed
            self.running.append(seq)
            todo = min(todo, budget)
            batch.append((seq, todo))
            budget -= todo
        return batch
