"""Pieces the model is built from and the engine calls, each swappable:

    attention.py   attention backends with one contract (the reference, PyTorch's fused one, yours)
    sampler.py     logits -> next token: greedy, temperature, top-k/p, min-p, per-request seeds
    linear.py      CPU linear layers with weights prepacked for oneDNN
"""
