"""A draft model: a small LM with the target's vocabulary guesses k tokens for every drafting sequence at once.

The draft keeps its K/V the way the target does: in a paged pool of its own (`KVPool`), each sequence
with its own block table (`DraftPool`, which hands out blocks and doubles the pool when it runs out).
Each sequence remembers which tokens its blocks hold. Before each proposal it keeps the longest prefix
that still agrees with the sequence (the target may have rejected some of the draft's guesses: rolling
back is just forgetting the positions past it, whose slots are overwritten later) and feeds the draft
whatever is new: the whole prompt the first time, afterwards the one to k+1 tokens the last
verification emitted.

A proposal is k batched steps over all drafting sequences (`minfer.engine.paged_kv.PagedStep`, the
target's attention path): the first feeds each sequence's new tokens and guesses from its last one;
each further step feeds every sequence its previous guess, one row each. The guesses stay on the
device until the last step: one transfer to the host per proposal, so a GPU never waits for the host
between the draft's steps. On CUDA those steps replay as CUDA graphs (`minfer.engine.cuda_graphs`):
every row is a decode row, the k-1 one-token steps always qualify, and so do catch-ups of up to
`max_query_len` tokens.

The draft samples with the request's own settings (temperature, top-k, top-p, min-p) and its
own generator, and returns the processed distributions it sampled from: the verifier needs
q(x) for min(1, p(x)/q(x)). In greedy mode it takes the argmax and returns no distribution.

A draft may have a reduced output head over the K most frequent tokens (`head_token_ids`, a
LongTensor [K] of target token ids): its logits are scattered into the full vocabulary with
-inf elsewhere, so it simply never proposes the other tokens. Acceptance stays exact.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from minfer.engine.cuda_graphs import DecodeGraphs, Recorder, record_cuda_graph
from minfer.engine.model_runner import PreparedStep
from minfer.engine.paged_kv import PagedStep, SequenceSlice
from minfer.host_copy import to_device
from minfer.layers.attention import attention_sdpa
from minfer.models.llama import LlamaModel
from minfer.sequence import Sequence
from minfer.speculative.batched_drafting import DraftPool, Guesses, PoolGraphs, pick_guesses, proposals
from minfer.speculative.proposer import Proposal, Proposer


@dataclass
class DraftState:
    """One sequence's blocks in the draft's pool, and the tokens whose K/V they hold, in order."""

    block_table: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    def __init__(self, model: LlamaModel, vocab_size: int, block_size: int = 16, max_num_seqs: int = 8,
                 max_query_len: int = 8, use_graphs: Optional[bool] = None, record: Recorder = record_cuda_graph) -> None:
        """vocab_size: the target's (the size of the distributions handed to the verifier). max_num_seqs,
        max_query_len: the largest steps CUDA graphs are recorded for (larger ones run eagerly). use_graphs:
        None means on CUDA; record: how a graph is recorded (`minfer.engine.cuda_graphs`)."""
        self.model, self.vocab_size = model, vocab_size
        self.head_token_ids = getattr(model, "head_token_ids", None)
        self.blocks = DraftPool(model, 64, block_size)
        self.device = model.embed_tokens.weight.device
        self.use_kernels = self.device.type == "cuda" and model.attention_fn is attention_sdpa
        if use_graphs is None:
            use_graphs = self.use_kernels and DecodeGraphs.supports(model)
        max_blocks = -(-model.config.max_position_embeddings // block_size)
        self.pool_graphs = PoolGraphs(lambda pool: DecodeGraphs(model, pool, max_num_seqs, max_blocks, record,
                                                                max_query_len)) if use_graphs else None
        self.state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> DraftState

    def release(self, seq: Sequence) -> None:
        state = self.state.pop(seq, None)
        if state is not None:
            self.blocks.release(state.block_table)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        # most guesses first: the sequences still guessing at step j are always the first rows of step j - 1
        drafting = sorted(((seq, k) for seq, k in zip(seqs, num_tokens) if k > 0), key=lambda item: -item[1])
        if not drafting:
            return [([], None) for _ in seqs]
        lengths = [seq.num_tokens for seq, _ in drafting]
        # catch up: each sequence feeds what the draft has not seen, then guesses from its last token. The step is
        # packed as the target's are, prompts (several tokens) before single tokens; the logits come in drafting order.
        news = []
        for (seq, k), length in zip(drafting, lengths):
            state = self.state.setdefault(seq, DraftState())
            common = self._common_prefix(state.held, seq.token_ids)
            del state.held[common:]  # roll back: those slots will be overwritten
            self.blocks.extend(state.block_table, length + k - 1)  # the last guess is never fed
            news.append(common)
        packing = sorted(range(len(drafting)), key=lambda i: lengths[i] - news[i] == 1)
        slices, feed, positions, last_row = [], [], [], [0] * len(drafting)
        for i in packing:
            seq, common, length = drafting[i][0], news[i], lengths[i]
            slices.append(SequenceSlice(len(feed), length - common, length, self.state[seq].block_table))
            feed += seq.token_ids_between(common, length)
            positions += range(common, length)
            last_row[i] = len(feed) - 1
        logits = self._forward(to_device(feed, self.device), positions, slices, last_row)
        guesses = [pick_guesses(logits, [seq for seq, _ in drafting], self.head_token_ids, self.vocab_size)]
        # guess j + 1 of every sequence that wants it, from its guess j: one row each, fed at position length + j - 1
        for j in range(1, drafting[0][1]):
            rows = sum(1 for _, k in drafting if k > j)
            slices = [SequenceSlice(i, 1, lengths[i] + j, self.state[drafting[i][0]].block_table) for i in range(rows)]
            logits = self._forward(guesses[-1][0][:rows], [lengths[i] + j - 1 for i in range(rows)], slices,
                                   list(range(rows)))
            guesses.append(pick_guesses(logits, [seq for seq, _ in drafting[:rows]], self.head_token_ids, self.vocab_size))
        return self._remember(seqs, drafting, guesses)

    @staticmethod
    def _common_prefix(held: list[int], tokens: list[int]) -> int:
        """How many leading tokens the draft's blocks hold right (at least one token is fed: its logits are needed).
        The two differ at most in the last few tokens (rejected guesses): compare the rest in one go, in C."""
        limit = min(len(held), len(tokens) - 1)
        walk_from = max(0, limit - 16)
        common = walk_from if held[:walk_from] == tokens[:walk_from] else 0
        while common < limit and held[common] == tokens[common]:
            common += 1
        return common

    def _forward(self, input_ids: torch.Tensor, positions: list[int], slices: list[SequenceSlice],
                 logits_rows: list[int]) -> torch.Tensor:
        """Run one packed step through the draft; logits [len(logits_rows), vocab the draft scores] in float32."""
        cpu_positions = torch.tensor(positions)
        paged = PagedStep(self.blocks.pool, slices, cpu_positions, self.use_kernels)
        step = PreparedStep(input_ids[None], to_device(cpu_positions[None], self.device), paged,
                            to_device(logits_rows, self.device, torch.long))
        served = None if self.pool_graphs is None else self.pool_graphs.serve(self.blocks.pool, step)
        if served is not None:
            return served[0]
        return self.model(step.input_ids, step.positions, paged, logits_indices=step.logits_indices)[0]

    @property
    def graphs(self) -> Optional[DecodeGraphs]:
        """The CUDA graphs recorded so far (None without graphs)."""
        return None if self.pool_graphs is None else self.pool_graphs.graphs

    def _remember(self, seqs: list[Sequence], drafting: list[tuple[Sequence, int]], guesses: list[Guesses]) -> list[Proposal]:
        """Each sequence's proposal; its blocks now hold its tokens and all its guesses but the last."""
        made = {}
        for (seq, _), (drafts, dists) in zip(drafting, proposals([k for _, k in drafting], guesses)):
            state = self.state[seq]
            state.held += seq.token_ids_between(len(state.held), seq.num_tokens) + drafts[:-1]
            made[seq] = (drafts, dists)
        return [made.get(seq, ([], None)) for seq in seqs]
