"""Chapter 05: prefix caching, from the block hash chain to the hit rate.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch05")` in the
notebook.
"""
from __future__ import annotations

from minfer.engine.block_manager import block_hash  # noqa: F401  (the engine's hash of one block)


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The hash chain of a token sequence: one hash per *full* block, in order.

    Block i holds tokens i*block_size .. (i+1)*block_size - 1; its hash is
    block_hash(tuple(those tokens), hash of block i-1), with None as the parent of block 0.
    A partly filled last block has no hash.
    """
    raise NotImplementedError("write me")


def cached_prefix_len(token_ids: list[int], cache: dict[int, tuple[int, ...]], block_size: int) -> int:
    """How many leading tokens of token_ids a prefix cache can serve without recomputing.

    cache maps a block hash to the tokens of the block stored under it, as a tuple (compare it with
    tuple(...) of the prompt's slice: a list never equals a tuple). Walk the blocks of
    token_ids in order and stop at the first block whose hash is missing or whose stored tokens
    differ (a hash collision). At least one token is always left to compute (the model needs
    the last token's logits), so only blocks lying entirely within token_ids[:-1] count.
    Returns a multiple of block_size.
    """
    raise NotImplementedError("write me")


def prefix_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """The prefix-cache hit rate of prompts served one after another by a cache that never forgets.

    Each prompt first looks up its cached prefix (as in `cached_prefix_len`), then, once
    computed, adds all of its full blocks to the cache. Returns cached prompt tokens / all
    prompt tokens (0.0 for no prompts).
    """
    raise NotImplementedError("write me")
