"""Triton kernels for the paged KV cache, each beside the plain PyTorch it must equal.

Read them in order, like lessons:

    paged_cache.py              the layout (pools, block tables, slots) and write_kv
    paged_decode_attention.py   one new token per sequence, online softmax over pages
    paged_prefill_attention.py  a chunk of new tokens per sequence, flash-attention tiles

Import from the modules themselves (``from minfer.kernels.paged_decode_attention import
paged_decode_attention``); this package re-exports nothing, so that a module and the function it
is named after never shadow each other.
"""
