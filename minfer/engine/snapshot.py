"""The engine's state at one moment, frozen: the one thing read from outside the engine.

    snap = engine.snapshot()                 # counts: queues, blocks, tokens, steps, preemptions
    snap = engine.snapshot(detail=True)      # and every sequence, every block, the last step's batch
    snap.spec_decode.draft_acceptance_rate   # with speculative decoding on
    snap.communication.all_reduces           # with tensor parallelism

A server's event loop, a notebook's live view (`minfer.lab.glass`) and the benchmarks read these
instead of the scheduler's lists and the block manager's tables. The live state changes on the
thread that steps the engine; a snapshot is built there, between steps, and never changes after.
The counts cost a few attribute reads, so a server takes one after every step; the detail walks
every sequence and block, so only views that draw them ask for it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from minfer.layers.parallel_linear import CommStats
from minfer.outputs import RequestMetrics
from minfer.sequence import Sequence
from minfer.speculative.stats import SpecDecodeStats

if TYPE_CHECKING:
    from minfer.engine.engine import Engine  # (which imports this module)


@dataclass(frozen=True)
class SequenceView:
    request_id: str
    index: int  # which of the request's n completions
    state: str  # "running", "waiting", or "preempted" (waiting to be recomputed)
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed: int  # tokens whose K/V are in the pool
    num_cached_prompt_tokens: int  # found in the prefix cache at admission
    block_table: tuple[int, ...]
    metrics: RequestMetrics  # a copy: arrival, first token, finish

    @property
    def label(self) -> str:
        """"request/completion", e.g. "3/0"."""
        return sequence_label(self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt_tokens


@dataclass(frozen=True)
class BlockView:
    block_id: int
    ref_count: int  # sequences whose block table holds it
    prefix_hash: Optional[int]  # set while the prefix cache can find it (a full block whose tokens are still there)
    parent_hash: Optional[int]  # the block before it in its sequence, for the prefix tree

    @property
    def state(self) -> str:
        """"used" (held), "cached" (free, but a prefix hit revives it) or "free"."""
        return "used" if self.ref_count > 0 else "cached" if self.prefix_hash is not None else "free"


@dataclass(frozen=True)
class EngineSnapshot:
    version: int  # grows with every snapshot: a later one replaces an earlier one, never the reverse
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting for a place in it (preempted ones included)
    num_requests: int  # requests the engine holds
    has_unfinished: bool  # anything running or waiting: another step has work
    num_free_blocks: int
    num_blocks: int
    block_size: int
    token_budget: int  # max_num_batched_tokens: tokens one step may compute
    prefix_hit_rate: float  # of first admissions' prompt tokens, the fraction found in the prefix cache
    steps: int
    computed_tokens: int  # run through the model: prefill chunks, recomputes, decodes
    padding_tokens: int  # rows added to reach each step's bucket
    peak_blocks_used: int
    num_preemptions: int
    spec_decode: Optional[SpecDecodeStats]  # a copy of the draft counts, with speculative decoding on (else None)
    communication: Optional[CommStats]  # a copy of rank 0's collectives, with tensor parallelism (else None)
    # with detail=True only (empty otherwise)
    sequences: tuple[SequenceView, ...] = ()  # running first, then waiting, each in queue order
    blocks: tuple[BlockView, ...] = ()
    last_step: tuple[tuple[str, int, str], ...] = ()  # (sequence label, tokens computed, "prefill" or "decode") of the last step
    last_padding: int = 0  # rows the last step added to reach its bucket
    request_ids: tuple[str, ...] = ()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (1 = full)."""
        return self.num_used_blocks / self.num_blocks


def sequence_label(request_id: str, index: int) -> str:
    return f"{request_id}/{index}"


def sequence_view(seq: Sequence, state: str) -> SequenceView:
    if state == "waiting" and seq.num_preemptions:
        state = "preempted"
    return SequenceView(seq.request_id, seq.index, state, len(seq.prompt_token_ids), len(seq.output_ids),
                        seq.num_computed, seq.num_cached_prompt_tokens, tuple(seq.block_table),
                        dataclasses.replace(seq.metrics))


def detail(engine: Engine) -> dict:
    """The detail fields: every sequence, every block, the last step's batch (walks them all)."""
    scheduler, blocks = engine.scheduler, engine.blocks
    findable = set(blocks.cached.values())  # block ids the prefix cache can find by hash
    sequences = [sequence_view(s, "running") for s in scheduler.running]
    sequences += [sequence_view(s, "waiting") for s in scheduler.waiting]
    block_views = [BlockView(b.block_id, b.ref_count, b.hash, b.parent_hash) if b.block_id in findable
                   else BlockView(b.block_id, b.ref_count, None, None) for b in blocks.blocks]
    last_step = [(sequence_label(seq.request_id, seq.index), count,
                  "decode" if count == 1 and seq.num_computed >= len(seq.prompt_token_ids) else "prefill")
                 for seq, count in engine.last_batch]
    return dict(sequences=tuple(sequences), blocks=tuple(block_views), last_step=tuple(last_step),
                last_padding=engine.last_padding, request_ids=tuple(engine.requests))


def take_snapshot(engine: Engine, version: int, with_detail: bool) -> EngineSnapshot:
    """Read the engine's state (on the thread that steps it, between steps)."""
    scheduler, blocks, stats = engine.scheduler, engine.blocks, engine.stats
    comm = getattr(engine.runner, "comm_stats", None)  # tensor parallelism's runner keeps one
    return EngineSnapshot(version, len(scheduler.running), len(scheduler.waiting), len(engine.requests),
                          scheduler.has_unfinished(), blocks.num_free_blocks, blocks.num_blocks, blocks.block_size,
                          scheduler.max_num_batched_tokens, engine.prefix_hit_rate, stats.steps, stats.computed_tokens,
                          stats.padding_tokens, stats.peak_blocks_used, scheduler.num_preemptions,
                          engine.spec_stats.copy() if engine.proposer is not None else None,
                          dataclasses.replace(comm) if comm is not None else None,
                          **(detail(engine) if with_detail else {}))
