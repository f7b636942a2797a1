"""Triton kernels for the paged KV cache (and the MoE MLP), each beside the plain PyTorch it must equal.

Read them in order, like lessons:

    paged_cache.py              the layout (pools, block tables, slots) and write_kv
    online_softmax.py           softmax over a row of keys one tile at a time: the update both attention kernels share
    paged_decode_attention.py   one new token per sequence, online softmax over pages
    paged_prefill_attention.py  a chunk of new tokens per sequence, flash-attention tiles
    quant_matmul.py             int8 and int4 weights, dequantized inside the matmul
    fused_moe.py                a mixture-of-experts MLP: token-expert pairs sorted by expert, two grouped matmuls

Import from the modules themselves (``from minfer.kernels.paged_decode_attention import
paged_decode_attention``); this package re-exports nothing, so that a module and the function it
is named after never shadow each other.

Without a GPU the tests run these kernels under Triton's interpreter; ``tests/test_kernel_compile.py``
also compiles every variant the engine launches for sm_80 and sm_90 (its default launches for sm_75, sm_86
and sm_89) and checks its shared memory
and registers (``python benchmarks/kernel_resources.py`` prints them).
"""
