"""Number formats shared by the kernels and the quantizers: plain tensor functions, no layers.

    weights.py   int8 per output channel; int4 in groups, two values per byte
    nf4.py       NF4 (QLoRA's 4-bit NormalFloat): 16 levels at normal quantiles, absmax per block
    kv.py        int8 KV cache entries, one scale per (token, KV head); fp8 (e4m3) ones, one per (layer, KV head)
    fp8.py       fp8 (e4m3) rows: weights per output channel, activations per token
    gguf_file.py a GGUF model file's header and tensor table (llama.cpp's format), read from the mapped file
    hardware.py  which formats a GPU computes in, by its compute capability (bfloat16 from sm_80, e4m3 from sm_89)

They import nothing of minfer but each other, so `minfer.kernels` (a leaf) and `minfer.quant`
(which applies the formats to a model) can both build on them without importing each other.
"""
