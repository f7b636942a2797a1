"""The EAGLE proposer: an `EagleHead` guesses k tokens from the target's own features.

The engine hands the proposer the target's pre-norm hidden states of every pass (`observe`: prefill
chunks, plain decode steps and verification passes). The proposer copies them into a per-sequence
buffer indexed by position. A verification pass also computes features at drafts the target went on
to reject; they are simply overwritten by the next pass, which starts at the first rejected position.
So when a sequence of n+1 tokens is ready to draft, the features at positions 0..n-1 are the
target's, all computed from accepted tokens.

The head keeps its one layer's K/V in a paged pool of its own, a block table per sequence
(`batched_drafting.py`, shared with the draft model). Its row t reads (f_t, token t+1). A proposal
guesses for every sequence at once: one step runs the rows that became final since the last proposal
(the whole prompt the first time, afterwards the one to k+1 positions the last pass accepted); the
last of each sequence's rows predicts f_{n}, whose logits give its first guess. Each further step
feeds every sequence its predicted feature and guessed token as one more row; those rows are
forgotten before the next proposal (their slots are overwritten), because the target's real
features replace them. On CUDA the steps replay as CUDA graphs (`EagleGraphs`).

A prompt served from the prefix cache is not computed, so its features never arrive: the head then
starts at the first position the target did compute (it guesses with less context, losslessly). So it
does after a gap (a preempted sequence readmitted with a longer prefix-cache hit than before).
Preemption recomputes a sequence: its features are rewritten, the head's rows stay valid (the tokens
did not change). Sampling follows the draft model's rules (`draft_model.py`): the request's own
settings, its generator, and the distribution q handed to the verifier; greedy returns no q.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from minfer.engine.cuda_graphs import DecodeGraphs, GraphStep, Recorder, record_cuda_graph
from minfer.engine.paged_kv import KVPool, PagedStep, SequenceSlice
from minfer.host_copy import to_device
from minfer.layers.attention import attention_sdpa
from minfer.sequence import Sequence
from minfer.speculative.batched_drafting import DraftPool, HeadStep, PoolGraphs, pick_guesses, proposals
from minfer.speculative.eagle_head import EagleHead
from minfer.speculative.proposer import Proposal, Proposer


@dataclass
class EagleState:
    """One sequence's features and the head's blocks over them."""

    features: torch.Tensor  # [positions, hidden]: the target's feature at each computed position
    start: int  # the first position whose feature arrived (later than 0 after a prefix-cache hit)
    known: int  # features start..known-1 have arrived
    block_table: list[int] = field(default_factory=list)  # the head's rows for positions start, start+1, ...
    rows: int = 0  # rows in the pool built from the target's features (the rest were guesses)


class EagleGraphs(DecodeGraphs):
    """The head's steps replayed as CUDA graphs: each row's feature is one more fixed input, and the outputs are
    the logits over the head's tokens and the predicted features."""

    def __init__(self, head: EagleHead, pool: KVPool, max_num_seqs: int, max_blocks_per_seq: int,
                 record: Recorder = record_cuda_graph, max_query_len: int = 1) -> None:
        super().__init__(head, pool, max_num_seqs, max_blocks_per_seq, record, max_query_len)
        self.features = torch.zeros(1, self.sizes[-1], head.config.hidden_size, dtype=head.fc.weight.dtype,
                                    device=pool.k.device)

    def _copy_inputs(self, step: HeadStep, rows: int) -> None:
        self.features[:, :rows] = step.features[:, :rows]

    def _forward(self, size: int, step: GraphStep, hidden_layers: Optional[tuple[int, ...]]) -> tuple:
        head = self.model
        predicted = head(self.features[:, :size], self.input_ids[:, :size], self.positions[:, :size], step)
        return head.logits(predicted), predicted


class EagleProposer(Proposer):
    needs_hidden_states = True

    def __init__(self, head: EagleHead, vocab_size: int, block_size: int = 16, max_num_seqs: int = 8,
                 max_query_len: int = 8, use_graphs: Optional[bool] = None, record: Recorder = record_cuda_graph) -> None:
        """vocab_size: the target's (the size of the distributions handed to the verifier). max_num_seqs,
        max_query_len: the largest steps CUDA graphs are recorded for (larger ones run eagerly). use_graphs:
        None means on CUDA; record: how a graph is recorded (`minfer.engine.cuda_graphs`)."""
        self.head, self.vocab_size = head, vocab_size
        self.feature_layers = head.feature_layers
        self.blocks = DraftPool(head, 64, block_size)
        self.device = head.fc.weight.device
        self.use_kernels = self.device.type == "cuda" and head.attention_fn is attention_sdpa
        if use_graphs is None:
            use_graphs = self.use_kernels
        max_blocks = -(-head.config.max_position_embeddings // block_size)
        self.pool_graphs = PoolGraphs(lambda pool: EagleGraphs(head, pool, max_num_seqs, max_blocks, record,
                                                               max_query_len)) if use_graphs else None
        self.state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> EagleState

    def release(self, seq: Sequence) -> None:
        state = self.state.pop(seq, None)
        if state is not None:
            self.blocks.release(state.block_table)

    @torch.inference_mode()
    def observe(self, seq: Sequence, first_position: int, hidden: torch.Tensor) -> None:
        hidden = self.head.read_features(hidden)  # EAGLE-3: several layers' outputs mixed into one feature
        end = first_position + len(hidden)
        state = self.state.get(seq)
        if state is None or first_position > state.known:
            # new, or a gap: a preempted sequence readmitted with a longer prefix-cache hit than before, whose
            # features in between never arrive. The head starts again after it, as after a prefix-cache hit.
            self.release(seq)
            state = EagleState(self.head.fc.weight.new_zeros(end, hidden.shape[-1]), first_position, first_position)
            self.state[seq] = state
        elif end > len(state.features):  # room as the sequence grows, doubling: not its longest length up front
            grown = state.features.new_zeros(max(end, 2 * len(state.features)), state.features.shape[1])
            grown[:len(state.features)] = state.features
            state.features = grown
        skip = max(0, state.start - first_position)  # positions before the head's first row are not needed
        state.features[first_position + skip:end] = hidden[skip:]
        state.known = max(state.known, end)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        drafting = []  # (sequence, k, its state, the first row to run, its newest position)
        for seq, k in zip(seqs, num_tokens):
            state, newest = self.state.get(seq), seq.num_tokens - 1  # the newest token's feature is not known yet
            first = None if state is None else state.start + state.rows
            if k > 0 and first is not None and first < newest:  # else no features: it decodes the ordinary way
                drafting.append((seq, k, state, first, newest))
        if not drafting:
            return [([], None) for _ in seqs]
        drafting.sort(key=lambda item: -item[1])  # most guesses first (`batched_drafting`)
        # catch up: the rows that became final, packed as the target's steps are (several rows before one)
        packing = sorted(range(len(drafting)), key=lambda i: drafting[i][4] - drafting[i][3] == 1)
        features, ids, positions, slices, last_row = [], [], [], [], [0] * len(drafting)
        for i in packing:
            seq, k, state, first, newest = drafting[i]
            self.blocks.extend(state.block_table, newest - state.start + k - 1)  # the last guess is never fed
            slices.append(SequenceSlice(len(positions), newest - first, newest - state.start, state.block_table))
            features.append(state.features[first:newest])
            ids += seq.token_ids_between(first + 1, newest + 1)
            positions += range(first - state.start, newest - state.start)
            last_row[i] = len(positions) - 1
            state.rows = newest - state.start  # the rows run now are final (the target's features)
        predicted, logits = self._forward(torch.cat(features), to_device(ids, self.device), positions,
                                          slices, last_row)
        seqs_in_order = [item[0] for item in drafting]
        guesses = [pick_guesses(logits, seqs_in_order, self.head.head_token_ids, self.vocab_size)]
        # each further guess: the predicted feature and the guessed token as one more row per sequence
        for j in range(1, drafting[0][1]):
            rows = sum(1 for item in drafting if item[1] > j)
            ends = [drafting[i][4] - drafting[i][2].start + j for i in range(rows)]  # rows each sequence then has
            slices = [SequenceSlice(i, 1, ends[i], drafting[i][2].block_table) for i in range(rows)]
            predicted, logits = self._forward(predicted[:rows], guesses[-1][0][:rows], [end - 1 for end in ends],
                                              slices, list(range(rows)))
            guesses.append(pick_guesses(logits, seqs_in_order[:rows], self.head.head_token_ids, self.vocab_size))
        made = dict(zip(seqs_in_order, proposals([item[1] for item in drafting], guesses)))
        return [made.get(seq, ([], None)) for seq in seqs]

    def _forward(self, features: torch.Tensor, input_ids: torch.Tensor, positions: list[int],
                 slices: list[SequenceSlice], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed step of the head: (predicted features [len(rows), hidden], logits [len(rows), head tokens])."""
        cpu_positions = torch.tensor(positions)
        paged = PagedStep(self.blocks.pool, slices, cpu_positions, self.use_kernels)
        step = HeadStep(input_ids[None], to_device(cpu_positions[None], self.device), paged,
                        to_device(rows, self.device, torch.long), hidden_layers=(), features=features[None])
        served = None if self.pool_graphs is None else self.pool_graphs.serve(self.blocks.pool, step)
        if served is not None:
            logits, predicted = served
            return predicted[step.logits_indices], logits
        predicted = self.head(step.features, step.input_ids, step.positions, paged)[0, step.logits_indices]
        return predicted, self.head.logits(predicted)

    @property
    def graphs(self) -> Optional[EagleGraphs]:
        """The CUDA graphs recorded so far (None without graphs)."""
        return None if self.pool_graphs is None else self.pool_graphs.graphs
