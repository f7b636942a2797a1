"""Chapter 05, worked: prefix caching, from the block hash chain to the hit rate."""
from __future__ import annotations

from minfer.engine.block_manager import block_hash


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The hash chain of a token sequence: one hash per *full* block, in order.

    Block i holds tokens i*block_size .. (i+1)*block_size - 1; its hash is
    block_hash(tuple(those tokens), hash of block i-1), with None as the parent of block 0.
    A partly filled last block has no hash.
    """
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = block_hash(tuple(token_ids[i * block_size:(i + 1) * block_size]), parent)
        hashes.append(parent)
    return hashes


def cached_prefix_len(token_ids: list[int], cache: dict[int, tuple[int, ...]], block_size: int) -> int:
    """How many leading tokens of token_ids a prefix cache can serve without recomputing.

    cache maps a block hash to the tokens of the block stored under it, as a tuple (compare it with
    tuple(...) of the prompt's slice: a list never equals a tuple). Walk the blocks of
    token_ids in order and stop at the first block whose hash is missing or whose stored tokens
    differ (a hash collision). At least one token is always left to compute (the model needs
    the last token's logits), so only blocks lying entirely within token_ids[:-1] count.
    Returns a multiple of block_size.
    """
    usable = token_ids[:-1]
    hits = 0
    for i, h in enumerate(block_hashes(usable, block_size)):
        if cache.get(h) != tuple(usable[i * block_size:(i + 1) * block_size]):
            break
        hits += 1
    return hits * block_size


def prefix_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """The prefix-cache hit rate of prompts served one after another by a cache that never forgets.

    Each prompt first looks up its cached prefix (as in `cached_prefix_len`), then, once
    computed, adds all of its full blocks to the cache. Returns cached prompt tokens / all
    prompt tokens (0.0 for no prompts).
    """
    cache: dict[int, tuple[int, ...]] = {}
    cached = total = 0
    for prompt in prompts:
        cached += cached_prefix_len(prompt, cache, block_size)
        total += len(prompt)
        for i, h in enumerate(block_hashes(prompt, block_size)):
            cache.setdefault(h, tuple(prompt[i * block_size:(i + 1) * block_size]))
    return cached / total if total else 0.0
