"""What the draft model and the EAGLE head share: drafting every sequence at once, in a paged pool of their own.

A proposer that runs a network (a draft model, an EAGLE head) guesses for all its sequences in k batched
steps: one catch-up step (each sequence's new rows, packed as the target's steps are), then one step per
further guess with one row per sequence. Its K/V live in a `DraftPool`, blocks per sequence as in the
target's pool, so that one `PagedStep` serves every sequence whatever its length, and on CUDA the steps
replay as CUDA graphs (`minfer.engine.cuda_graphs`: every row is a decode row).

Sequences are ordered by how many guesses they want, most first, so that the sequences still guessing at
step j are the first rows of step j - 1. The guesses stay on the device until the last step: one transfer
to the host per proposal (`proposals`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from minfer.engine.cuda_graphs import DecodeGraphs
from minfer.engine.model_runner import PreparedStep
from minfer.engine.paged_kv import KVPool
from minfer.host_copy import to_device
from minfer.layers.sampler import draw
from minfer.sequence import Sequence
from minfer.speculative.proposer import Proposal
from minfer.speculative.rejection import processed_probs

# one step's guesses: token ids [rows] on the device, and each row's distribution (None where greedy)
Guesses = tuple[torch.Tensor, list[Optional[torch.Tensor]]]


class DraftPool:
    """A drafting network's KV pool and its free blocks. Out of blocks, it doubles: a new pool, the old contents
    copied in (CUDA graphs recorded over the old pool are then recorded anew)."""

    def __init__(self, network: torch.nn.Module, num_blocks: int, block_size: int) -> None:
        """network: a LlamaModel or an EagleHead (its config gives the pool's shape, its embedding the dtype)."""
        self.config, self.block_size = network.config, block_size
        weight = network.embed_tokens.weight
        self.pool = KVPool(self.config, num_blocks, block_size, weight.dtype, weight.device)
        self.free = list(range(num_blocks))

    def extend(self, table: list[int], num_tokens: int) -> None:
        """Give `table` the blocks that num_tokens positions need (lowest free blocks first, so that a
        sequence's blocks tend to follow each other and the CPU path reads them in place)."""
        wanted = -(-num_tokens // self.block_size) - len(table)
        if wanted <= 0:
            return
        while len(self.free) < wanted:
            self._grow()
        self.free.sort()
        table += self.free[:wanted]
        del self.free[:wanted]

    def release(self, table: list[int]) -> None:
        self.free += table
        table.clear()

    def _grow(self) -> None:
        old = self.pool
        self.pool = KVPool(self.config, 2 * old.num_blocks, self.block_size, old.dtype, old.k.device)
        self.pool.k[:, :, :old.num_blocks] = old.k  # heads-first: [layers, kv_heads, blocks, block_size, dim]
        self.pool.v[:, :, :old.num_blocks] = old.v
        self.free += range(old.num_blocks, self.pool.num_blocks)


class PoolGraphs:
    """A drafting network's CUDA graphs, recorded over its DraftPool's current pool: recorded anew once the pool
    has grown (the old recordings point at the old pool's memory)."""

    def __init__(self, make: Callable[[KVPool], DecodeGraphs]) -> None:
        self.make, self.graphs = make, None

    def serve(self, pool: KVPool, step: PreparedStep) -> Optional[tuple]:
        """The step replayed over `pool` (graphs recorded anew if the pool grew): what `DecodeGraphs` returns, or
        None where the graphs do not serve the step (it then runs eagerly)."""
        if self.graphs is None or self.graphs.pool is not pool:
            self.graphs = self.make(pool)
        return self.graphs(step) if self.graphs.serves(step) else None


@dataclass
class HeadStep(PreparedStep):
    """A prepared step of an EAGLE head: the target's (or the head's own) feature for every row as well."""

    features: Optional[torch.Tensor] = None  # [1, rows, hidden]


def pick_guesses(logits: torch.Tensor, seqs: list[Sequence], head_token_ids: Optional[torch.Tensor],
                 vocab_size: int) -> Guesses:
    """One guess per row of logits [rows, scored tokens] (a device tensor [rows]) and, for sampled rows, the
    distribution over the target's vocabulary it was drawn from: the request's own settings and generator.
    head_token_ids: the target ids of the scored tokens when the network scores only some (None: all), on the
    logits' device (a buffer of the drafting network)."""
    if all(seq.params.greedy for seq in seqs):
        best = logits.argmax(dim=-1)
        return (best if head_token_ids is None else head_token_ids[best]), [None] * len(seqs)
    full = logits
    if head_token_ids is not None:  # the other tokens are never proposed: -inf
        full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
        full[:, head_token_ids] = logits
    tokens, dists = [], []
    for row, seq in zip(full, seqs):
        if seq.params.greedy:
            tokens.append(row.argmax(dim=-1, keepdim=True))
            dists.append(None)
        else:
            q = processed_probs(row[None], seq.params)[0]
            tokens.append(draw(q[None], to_device(torch.rand(1, generator=seq.generator), q.device)))
            dists.append(q)
    return torch.cat(tokens), dists


def proposals(num_guesses: list[int], guesses: list[Guesses]) -> list[Proposal]:
    """The guesses to the host at once (the proposal's only transfer); row i's first num_guesses[i] of them, with
    their distributions when sampled. Row i took part in every step j < num_guesses[i], as row i."""
    ids = [g.tolist() for g, _ in guesses]
    made = []
    for i, k in enumerate(num_guesses):
        dists = [guesses[j][1][i] for j in range(k)]
        made.append(([ids[j][i] for j in range(k)], None if dists[0] is None else torch.stack(dists)))
    return made
