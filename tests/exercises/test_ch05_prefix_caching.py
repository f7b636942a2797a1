"""Chapter 05: the hash chain, the cached prefix and the hit rate, against the engine's BlockManager."""
import pytest
import torch

from minfer.engine.block_manager import BlockManager, block_hash


def random_tokens(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, 50, (n,), generator=gen).tolist()  # a small vocabulary: repeats happen


def serve(manager: BlockManager, prompt: list[int]) -> int:
    """One request through the engine's block manager, alone: look up, compute (seal), finish (free)."""
    table, cached = manager.allocate(prompt)
    manager.seal_full_blocks(table, prompt, len(prompt))
    manager.free(table)
    return cached


def cache_of(manager: BlockManager) -> dict:
    return {h: manager.blocks[b].token_ids for h, b in manager.cached.items()}


# ----------------------------------------------------------------- the chain

@pytest.mark.parametrize("length,block_size", [(0, 4), (3, 4), (4, 4), (13, 4), (40, 16)])
def test_block_hashes_equal_the_engines_sealed_blocks(impl, length, block_size):
    prompt = random_tokens(length, torch.Generator().manual_seed(length))
    manager = BlockManager(16, block_size)
    table, _ = manager.allocate(prompt or [0])
    manager.seal_full_blocks(table, prompt, len(prompt))
    expected = [manager.blocks[b].hash for b in table[:len(prompt) // block_size]]
    assert impl.block_hashes(prompt, block_size) == expected


def test_a_hash_names_the_whole_prefix(impl):
    a = list(range(12))
    b = [99] + a[1:]  # differs only in the first token
    ha, hb = impl.block_hashes(a, 4), impl.block_hashes(b, 4)
    assert len(ha) == 3 and ha[0] == block_hash((0, 1, 2, 3), None)
    assert all(x != y for x, y in zip(ha, hb))  # equal later blocks, different prefixes: different names


# ----------------------------------------------------------------- the longest cached prefix

@pytest.mark.parametrize("seed", range(5))
def test_cached_prefix_len_equals_the_block_manager(impl, seed):
    gen = torch.Generator().manual_seed(seed)
    block_size = 4
    manager = BlockManager(64, block_size)
    system = random_tokens(11, gen)
    for _ in range(6):  # some requests sharing a prefix of random length, served one by one
        serve(manager, system[:int(torch.randint(0, 12, (1,), generator=gen))] + random_tokens(9, gen))
    cache = cache_of(manager)
    for _ in range(20):
        probe = system[:int(torch.randint(0, 12, (1,), generator=gen))] + random_tokens(int(torch.randint(1, 9, (1,), generator=gen)), gen)
        expected = len(manager.cached_prefix(probe)) * block_size
        assert impl.cached_prefix_len(probe, cache, block_size) == expected, probe


def test_cached_prefix_leaves_the_last_token(impl):
    prompt = list(range(8))
    cache = {h: tuple(prompt[i * 4:(i + 1) * 4]) for i, h in enumerate(impl.block_hashes(prompt, 4))}
    assert impl.cached_prefix_len(prompt, cache, 4) == 4  # not 8: the last token must be computed
    assert impl.cached_prefix_len(prompt + [8], cache, 4) == 8


def test_cached_prefix_confirms_the_tokens(impl):
    prompt = list(range(9))
    h0, h1 = impl.block_hashes(prompt, 4)
    collided = {h0: (0, 1, 2, 3), h1: (7, 7, 7, 7)}  # block 1's hash is stored, but for other tokens
    assert impl.cached_prefix_len(prompt, collided, 4) == 4
    assert impl.cached_prefix_len(prompt, {h1: (4, 5, 6, 7)}, 4) == 0  # no first block: nothing after it counts


# ----------------------------------------------------------------- the hit rate

@pytest.mark.parametrize("seed", range(4))
def test_prefix_hit_rate_equals_the_block_manager(impl, seed):
    gen = torch.Generator().manual_seed(seed)
    block_size = 4
    shared = random_tokens(20, gen)
    prompts = [shared[:int(torch.randint(0, 21, (1,), generator=gen))] + random_tokens(int(torch.randint(1, 10, (1,), generator=gen)), gen)
               for _ in range(10)]
    manager = BlockManager(256, block_size)  # big enough that nothing is evicted
    cached = sum(serve(manager, p) for p in prompts)
    assert impl.prefix_hit_rate(prompts, block_size) == pytest.approx(cached / sum(map(len, prompts)))


def test_prefix_hit_rate_by_hand(impl):
    system = list(range(100, 116))  # 16 shared tokens, 4 blocks of 4
    prompts = [system + [1, 2, 3], system + [4, 5], [6, 7] + system]
    # first: nothing cached; second: the 16 system tokens; third: the system prompt is not at the front
    assert impl.prefix_hit_rate(prompts, 4) == pytest.approx(16 / (19 + 18 + 18))
    assert impl.prefix_hit_rate([], 4) == 0.0
