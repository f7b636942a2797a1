"""Paged KV memory: a pool of fixed-size blocks that sequences borrow and give back.

A contiguous cache reserves max_len slots per sequence up front, most of which a short answer
never uses. Here a sequence holds a *block table*, a list of block ids, and gets one more block
only when its last one is full: the waste is at most one partly filled block per sequence.

Prefix caching rides on the same structure. A full block is named by a hash of (the hash of the
block before it, its token ids), so equal hashes mean equal prefixes. A new sequence whose first
blocks hash to blocks already in memory shares them (reference counts say how many sequences
hold a block) and skips their prefill. A block whose last holder finishes goes back to the free
list but keeps its hash: until it is handed out again (least recently freed first) a later
request can still find it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional


class OutOfBlocks(RuntimeError):
    """The pool cannot serve this request now (the scheduler waits or preempts)."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: Optional[int] = None  # set once the block is full and its tokens are known
    parent_hash: Optional[int] = None  # the hash of the block before it in its sequence (None: the first)
    token_ids: tuple[int, ...] = field(default=())


ROOT_HASH = 0x6D696E66  # the "parent" of a sequence's first block


def block_hash(token_ids: tuple[int, ...], parent_hash: Optional[int]) -> int:
    """Names a full block by everything before it and its own tokens (None: the first block): 128 bits of SHA-256.

    Not Python's hash(): on a server shared by many clients, a name that one client could make collide on purpose
    would hand it, or serve from it, another client's keys and values. A hit compares the block's own tokens, but
    not the prefix before them: only the chained name stands for that."""
    parent = (ROOT_HASH if parent_hash is None else parent_hash).to_bytes(16, "little")
    digest = hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()
    return int.from_bytes(digest[:16], "little")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self.cached: dict[int, int] = {}  # block hash -> block id, for full blocks still holding their tokens

    # ---------------------------------------------------------------- bookkeeping
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free_block(self) -> Block:
        if not self.free_ids:
            raise OutOfBlocks("no free KV blocks")
        block = self.blocks[self.free_ids.popitem(last=False)[0]]
        if block.hash is not None and self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]  # its old content is about to be overwritten
        block.hash, block.parent_hash, block.token_ids, block.ref_count = None, None, (), 1
        return block

    def _share(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_ids[block.block_id]  # a cached block back from the free list
        block.ref_count += 1

    # ---------------------------------------------------------------- the sequence's life
    def cached_prefix(self, token_ids: list[int], use_cache: bool = True) -> list[Block]:
        """The longest run of full blocks at the start of token_ids that memory already holds.

        At least one token is always left to compute: the model must produce logits for the last one.
        use_cache=False: no hits for this sequence (it needs the logits of every prompt position).
        """
        if not self.enable_prefix_caching or not use_cache:
            return []
        hits, parent = [], None
        usable = (len(token_ids) - 1) // self.block_size
        for i in range(usable):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = block_hash(tokens, parent)
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:  # confirm: hashes can collide
                break
            hits.append(self.blocks[block_id])
        return hits

    def can_allocate(self, token_ids: list[int], use_cache: bool = True) -> bool:
        hits = self.cached_prefix(token_ids, use_cache)
        revived = sum(b.ref_count == 0 for b in hits)  # cached but free: taking them uses free blocks
        return self.blocks_needed(len(token_ids)) - len(hits) + revived <= self.num_free_blocks

    def allocate(self, token_ids: list[int], use_cache: bool = True) -> tuple[list[int], int]:
        """Blocks for a new sequence's tokens. Returns (block table, number of tokens already cached)."""
        if not self.can_allocate(token_ids, use_cache):
            raise OutOfBlocks(f"{self.blocks_needed(len(token_ids))} blocks needed, {self.num_free_blocks} free")
        hits = self.cached_prefix(token_ids, use_cache)
        for block in hits:
            self._share(block)
        table = [b.block_id for b in hits]
        for _ in range(self.blocks_needed(len(token_ids)) - len(hits)):
            table.append(self._take_free_block().block_id)
        return table, len(hits) * self.block_size

    def can_append(self, num_tokens_after: int, table: list[int]) -> bool:
        return self.blocks_needed(num_tokens_after) - len(table) <= self.num_free_blocks

    def append(self, table: list[int], num_tokens_after: int) -> None:
        """Grow a block table so that it holds num_tokens_after tokens."""
        if not self.can_append(num_tokens_after, table):
            raise OutOfBlocks("no free KV block for the next token")
        while len(table) < self.blocks_needed(num_tokens_after):
            table.append(self._take_free_block().block_id)

    def seal_full_blocks(self, table: list[int], token_ids: list[int], num_computed: int) -> None:
        """Register the hashes of blocks that are now full of computed tokens (for later requests)."""
        if not self.enable_prefix_caching:
            return
        # sealed blocks form the start of a table (a hash needs its parent's): walk back from the last
        # full block to the last sealed one, so that a step costs the same however long the sequence is
        first = num_computed // self.block_size
        while first > 0 and self.blocks[table[first - 1]].hash is None:
            first -= 1
        parent = self.blocks[table[first - 1]].hash if first else None
        for i in range(first, num_computed // self.block_size):
            block = self.blocks[table[i]]
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            block.hash, block.parent_hash, block.token_ids = block_hash(tokens, parent), parent, tokens
            self.cached.setdefault(block.hash, block.block_id)
            parent = block.hash

    def free(self, table: list[int]) -> None:
        """A sequence is done (finished, aborted or preempted): give its blocks back, last first."""
        for block_id in reversed(table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_ids[block_id] = None
        table.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`), so that the next prompts are computed
        in full. Only while no sequence holds a block: a running sequence's full blocks must keep their
        names. Returns whether it reset."""
        if self.num_free_blocks < self.num_blocks:
            return False
        for block in self.blocks:
            block.hash, block.parent_hash, block.token_ids = None, None, ()
        self.cached.clear()
        return True

    def check_invariants(self, tables: list[list[int]]) -> None:
        """Every block is either free or held, reference counts equal the holders, used + free = total."""
        holders: dict[int, int] = {}
        for table in tables:
            for block_id in table:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.blocks:
            expected = holders.get(block.block_id, 0)
            assert block.ref_count == expected, f"block {block.block_id}: ref_count {block.ref_count} != {expected} holders"
            assert (block.block_id in self.free_ids) == (expected == 0), f"block {block.block_id} free-list state is wrong"
        assert len(holders) + self.num_free_blocks == self.num_blocks
