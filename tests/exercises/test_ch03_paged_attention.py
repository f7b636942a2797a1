"""Chapter 03: slots and block tables against the engine's BlockManager, paged attention against the
kernels' PyTorch reference, and online softmax against the plain softmax."""
import math

import pytest
import torch

from minfer.engine.block_manager import BlockManager
from minfer.kernels.paged_cache import slots_for_positions, write_kv_reference
from minfer.kernels.paged_decode_attention import paged_decode_attention_reference


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ----------------------------------------------------------------- slots and block tables

@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_for_matches_the_kernels_slot_mapping(impl, block_size):
    table = [7, 2, 9, 0]
    positions = torch.arange(len(table) * block_size)
    expected = slots_for_positions(torch.tensor(table), positions, block_size).tolist()
    assert [impl.slot_for(table, p, block_size) for p in positions.tolist()] == expected


def test_slot_for_has_no_block_past_the_table(impl):
    with pytest.raises(IndexError):
        impl.slot_for([3, 1], 8, 4)


def test_grow_block_table_hands_out_blocks_like_the_block_manager(impl, gen):
    block_size = 4
    manager = BlockManager(num_blocks=12, block_size=block_size, enable_prefix_caching=False)
    free = list(manager.free_ids)
    ours, theirs = [[], [], []], [[], [], []]
    lengths = [0, 0, 0]
    for _ in range(15):  # three sequences growing by random amounts, interleaved
        seq = int(torch.randint(3, (1,), generator=gen))
        lengths[seq] += int(torch.randint(1, 4, (1,), generator=gen))
        if not manager.can_append(lengths[seq], theirs[seq]):
            break
        manager.append(theirs[seq], lengths[seq])
        impl.grow_block_table(ours[seq], free, lengths[seq], block_size)
        assert ours == theirs
        assert free == list(manager.free_ids)
        manager.check_invariants(theirs)
    assert sum(map(len, ours)) > 3  # the walk did grow the tables


def test_grow_block_table_leaves_a_long_enough_table_alone(impl):
    table, free = [5, 6], [1, 2, 3]
    impl.grow_block_table(table, free, 7, 4)
    assert table == [5, 6] and free == [1, 2, 3]
    impl.grow_block_table(table, free, 9, 4)
    assert table == [5, 6, 1] and free == [2, 3]


def test_grow_block_table_refuses_without_changing_anything(impl):
    table, free = [0], [4, 5]
    with pytest.raises(RuntimeError) as refused:
        impl.grow_block_table(table, free, 4 * 4, 4)  # needs 3 more blocks, 2 are free
    assert not isinstance(refused.value, NotImplementedError), "still a stub"
    assert table == [0] and free == [4, 5]


# ----------------------------------------------------------------- paged attention

def paged_pools(lengths_kv_heads_dim, block_size, gen, num_blocks=12):
    """Random pools (garbage everywhere) with one sequence's K/V written into shuffled blocks."""
    length, kv_heads, head_dim = lengths_kv_heads_dim
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:math.ceil(length / block_size)].tolist()
    k = torch.randn(length, kv_heads, head_dim, generator=gen)
    v = torch.randn(length, kv_heads, head_dim, generator=gen)
    write_kv_reference(k_pool, v_pool, k, v, slots_for_positions(torch.tensor(table), torch.arange(length), block_size))
    return k_pool, v_pool, table


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("length,block_size", [(1, 4), (8, 4), (13, 4), (37, 16)])
def test_paged_attention_equals_the_kernels_reference(impl, gen, heads, kv_heads, length, block_size):
    head_dim = 8
    k_pool, v_pool, table = paged_pools((length, kv_heads, head_dim), block_size, gen)
    q = torch.randn(heads, head_dim, generator=gen)
    expected = paged_decode_attention_reference(q[None], k_pool, v_pool, torch.tensor([table], dtype=torch.int32),
                                                torch.tensor([length], dtype=torch.int32))[0]
    torch.testing.assert_close(impl.paged_attention(q, k_pool, v_pool, table, length), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_uses_the_scale(impl, gen):
    k_pool, v_pool, table = paged_pools((10, 2, 8), 4, gen)
    q = torch.randn(4, 8, generator=gen)
    expected = paged_decode_attention_reference(q[None], k_pool, v_pool, torch.tensor([table], dtype=torch.int32),
                                                torch.tensor([10], dtype=torch.int32), scale=0.7)[0]
    torch.testing.assert_close(impl.paged_attention(q, k_pool, v_pool, table, 10, scale=0.7), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- online softmax

def plain_attention(q, k, v, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(k @ q * scale, dim=0) @ v


@pytest.mark.parametrize("n,chunk", [(1, 4), (16, 4), (17, 4), (50, 7), (50, 64)])
def test_online_softmax_equals_softmax(impl, gen, n, chunk):
    q, k, v = torch.randn(16, generator=gen), torch.randn(n, 16, generator=gen), torch.randn(n, 16, generator=gen)
    torch.testing.assert_close(impl.online_softmax_attention(q, k, v, chunk), plain_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_online_softmax_survives_huge_scores(impl, gen):
    # scores in the thousands: exp() overflows unless every chunk subtracts the running maximum
    q = torch.full((8,), 30.0)
    k = torch.randn(40, 8, generator=gen) * 30
    k[33] = 60.0  # the largest score comes late, after the running maximum was set by earlier chunks
    v = torch.randn(40, 8, generator=gen)
    out = impl.online_softmax_attention(q, k, v, 8, scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, plain_attention(q, k, v, 1.0), rtol=1e-5, atol=1e-5)


def test_online_softmax_never_calls_softmax(impl, gen, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("online softmax must not call softmax over the scores")

    q, k, v = torch.randn(8, generator=gen), torch.randn(20, 8, generator=gen), torch.randn(20, 8, generator=gen)
    expected = plain_attention(q, k, v)
    monkeypatch.setattr(torch, "softmax", forbidden)
    monkeypatch.setattr(torch.nn.functional, "softmax", forbidden)
    monkeypatch.setattr(torch.Tensor, "softmax", forbidden)
    torch.testing.assert_close(impl.online_softmax_attention(q, k, v, 4), expected, rtol=1e-5, atol=1e-5)
