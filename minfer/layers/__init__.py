"""Pieces the model is built from and the engine calls, each swappable:

    attention.py   attention backends with one contract (the reference, PyTorch's fused one, yours)
    sampler.py     logits -> next token: greedy, temperature, top-k/p, min-p, per-request seeds
    linear.py      CPU linear layers with weights prepacked for oneDNN
    moe.py         the mixture-of-experts MLP: route each token to k of E experts, then mix their outputs
    parallel_linear.py  tensor parallelism's column- and row-parallel linears and the shard's ModelConfig
"""
