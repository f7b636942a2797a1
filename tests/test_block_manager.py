"""The paged KV block pool: allocation, growth, prefix sharing, eviction, and invariants under random use."""
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minfer.engine.block_manager import BlockManager, OutOfBlocks, block_hash


def test_allocate_grow_and_free():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    table, cached = bm.allocate(list(range(6)))  # 6 tokens -> 2 blocks
    assert len(table) == 2 and cached == 0 and bm.num_free_blocks == 2
    bm.append(table, 8)  # still fits in 2 blocks
    assert len(table) == 2
    bm.append(table, 9)  # the 9th token needs a third block
    assert len(table) == 3 and bm.num_free_blocks == 1
    bm.check_invariants([table])
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 4
    bm.check_invariants([])


def test_out_of_blocks_is_refused_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(list(range(9)))
    with pytest.raises(OutOfBlocks):
        bm.allocate(list(range(9)))
    assert bm.num_free_blocks == 2


def test_prefix_blocks_are_shared_and_confirmed_by_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    system = list(range(100, 108))  # two full blocks of shared prefix
    first, cached = bm.allocate(system + [1, 2, 3])
    assert cached == 0
    bm.seal_full_blocks(first, system + [1, 2, 3], num_computed=11)
    second, cached = bm.allocate(system + [7, 7])
    assert cached == 8 and second[:2] == first[:2] and second[2] != first[2]
    assert bm.blocks[first[0]].ref_count == 2
    other, cached = bm.allocate([100, 101, 102, 999] + [5] * 5)  # differs inside the first block
    assert cached == 0
    bm.check_invariants([first, second, other])


def test_one_token_is_always_left_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    table, _ = bm.allocate(prompt)
    bm.seal_full_blocks(table, prompt, 8)
    again, cached = bm.allocate(prompt)  # both blocks cached, but the last token must be recomputed
    assert cached == 4 and again[0] == table[0] and again[1] != table[1]


def test_freed_cached_blocks_survive_until_reused_lru():
    bm = BlockManager(num_blocks=3, block_size=2)
    a_prompt, b_prompt = [1, 2, 3], [5, 6, 7]
    a, _ = bm.allocate(a_prompt)
    bm.seal_full_blocks(a, a_prompt, 3)
    bm.free(a)
    assert bm.num_free_blocks == 3
    again, cached = bm.allocate(a_prompt)  # the freed block still holds [1, 2]
    assert cached == 2
    bm.free(again)
    b, _ = bm.allocate(b_prompt)  # takes the least recently freed blocks first
    bm.seal_full_blocks(b, b_prompt, 3)
    bm.free(b)
    c, _ = bm.allocate([9, 9, 9, 9, 9])  # needs all 3 blocks: every cached prefix is overwritten
    bm.free(c)
    _, cached = bm.allocate(a_prompt)
    assert cached == 0


def test_reset_forgets_every_prefix_but_only_when_nothing_is_held():
    bm = BlockManager(num_blocks=4, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    table, _ = bm.allocate(prompt)
    bm.seal_full_blocks(table, prompt, 5)
    assert not bm.reset_prefix_cache()  # held: its full blocks keep their names
    assert bm.cached_prefix(prompt) and bm.blocks[table[0]].hash is not None
    bm.free(table)
    assert bm.reset_prefix_cache()
    assert bm.cached_prefix(prompt) == [] and bm.allocate(prompt)[1] == 0
    assert all(b.hash is None for b in bm.blocks) and bm.num_free_blocks == 1


def test_allocation_counts_cached_free_blocks_as_used():
    bm = BlockManager(num_blocks=2, block_size=2)
    prompt = [1, 2, 3]
    table, _ = bm.allocate(prompt)
    bm.seal_full_blocks(table, prompt, 3)
    bm.free(table)
    # reusing the cached block takes it off the free list: 2 blocks needed, 2 free
    assert bm.can_allocate(prompt)
    table, cached = bm.allocate(prompt)
    assert cached == 2 and bm.num_free_blocks == 0


operations = st.lists(st.tuples(st.sampled_from(["add", "grow", "finish"]), st.integers(0, 10**6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=operations, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12),
       caching=st.booleans())
def test_invariants_hold_under_random_workloads(ops, block_size, num_blocks, caching):
    bm = BlockManager(num_blocks, block_size, caching)
    running: list[tuple[list[int], list[int]]] = []  # (block table, tokens)
    for op, r in ops:
        if op == "add":
            prompt = [r % 3] * (1 + r % 7)  # few distinct tokens: prefixes collide often
            if bm.can_allocate(prompt):
                table, cached = bm.allocate(prompt)
                assert cached % block_size == 0 and cached < len(prompt)
                bm.seal_full_blocks(table, prompt, len(prompt))
                running.append((table, prompt))
            else:
                with pytest.raises(OutOfBlocks):
                    bm.allocate(prompt)
        elif op == "grow" and running:
            table, tokens = running[r % len(running)]
            if bm.can_append(len(tokens) + 1, table):
                bm.append(table, len(tokens) + 1)
                tokens.append(r % 3)
                bm.seal_full_blocks(table, tokens, len(tokens))
        elif op == "finish" and running:
            table, _ = running.pop(r % len(running))
            bm.free(table)
        bm.check_invariants([t for t, _ in running])
    for table, _ in running:
        bm.free(table)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks



class CountingList(list):
    """A token list that counts the slices taken from it (sealing takes one per block it hashes)."""

    slices = 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            CountingList.slices += 1
        return super().__getitem__(index)


def test_sealing_hashes_only_the_blocks_that_just_filled():
    # A step of a long sequence must cost what a step of a short one does: each block is hashed
    # once however often sealing is asked for, into the same chain as one pass over the whole sequence.
    bm = BlockManager(num_blocks=64, block_size=4)
    tokens = CountingList(range(100))
    table, _ = bm.allocate(list(range(5)))
    CountingList.slices = 0
    for computed in range(5, 101):
        bm.append(table, computed)
        bm.seal_full_blocks(table, tokens, computed)
    assert CountingList.slices == 25  # 100 tokens, 25 blocks
    at_once = BlockManager(num_blocks=64, block_size=4)
    other, _ = at_once.allocate(list(range(100)))
    at_once.seal_full_blocks(other, list(range(100)), 100)
    assert [bm.blocks[b].hash for b in table] == [at_once.blocks[b].hash for b in other]
    assert None not in [bm.blocks[b].hash for b in table]


def test_block_names_do_not_collide_where_pythons_hash_does():
    """Python's hash of an int is taken modulo 2**61 - 1: parents that differ by that would name the next block alike
    (another prefix's keys and values served from the cache). The names are chained SHA-256, stable across runs."""
    tokens, parent = (1, 2, 3, 4), block_hash((5, 6, 7, 8), None)
    assert hash(parent) == hash(parent + 2**61 - 1)
    assert block_hash(tokens, parent) != block_hash(tokens, parent + 2**61 - 1)
    assert block_hash(tokens, None) != block_hash(tokens[::-1], None) and block_hash(tokens, None) < 2**128
    code = "from minfer.engine.block_manager import block_hash; print(block_hash((1, 2, 3, 4), None))"
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(other_process.stdout) == block_hash(tokens, None)
