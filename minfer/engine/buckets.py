"""Step shapes in buckets: every step's token count is padded up to one of a few fixed sizes.

A step packs the new tokens of all its sequences into one row of T tokens, and every linear layer
of the model multiplies a [T, hidden] matrix. Left alone, T takes every value from 1 to
max_num_batched_tokens as requests come and go, and every new T is a new matmul shape:

* on CPU, oneDNN (PyTorch's matmul library for bfloat16 and the prepacked weights) compiles a
  kernel for each new shape inside the step that first meets it, and keeps it in its primitive
  cache (up to ONEDNN_PRIMITIVE_CACHE_CAPACITY = 1024 entries by default): a long-running server
  pays compiles in its decode loop and its resident memory climbs until the cache is full;
* compiled decode (`minfer.engine.compiled_decode`, `enforce_eager=False`) compiles one graph per
  step shape, so it needs a bounded set of sizes too: one graph per bucket (CUDA graphs, recorded for
  one fixed shape each, use the same sizes: `minfer.engine.cuda_graphs`).

So the model runner pads each step to `bucket_for(T)` tokens. The padding rows go through the
linear layers and the norms (row by row: they change no real row), attention skips them
(`PagedStep.attend`), and no logits are read from them.

The sizes come from a measurement (`benchmarks/step_cost.py`; docs/benchmarks.md, "Long-running
stability"): on SmolLM2-135M a step of up to 16 tokens costs about what one token costs (reading
the weights dominates), so padding there is free and powers of two suffice; above 16 a step's cost
grows with T, so the buckets follow at most a third of their size apart (the soak padded 5 % of
its rows).
"""
from __future__ import annotations

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
LARGE_STEP = 256  # past the last bucket (prompts unchunked, a larger token budget): multiples of this


def bucket_for(num_tokens: int) -> int:
    """The smallest bucket holding num_tokens (past 512: the next multiple of 256)."""
    if num_tokens < 1:
        raise ValueError(f"a step has at least one token, got {num_tokens}")
    for size in TOKEN_BUCKETS:
        if size >= num_tokens:
            return size
    return -(-num_tokens // LARGE_STEP) * LARGE_STEP
