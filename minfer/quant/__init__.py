"""Quantization: smaller number formats for weights and the KV cache, each module one format.

    weights.py     int8 per output channel; int4 in groups, two values per byte (formats only)
    torch_ops.py   PyTorch's own CPU kernels for those formats, and the layout they need
    linear.py      Int8Linear / Int4Linear, quantize_model, and byte counts
    gguf_q4_1.py   GGUF's Q4_1 blocks read from a file: the same group-wise int4 idea
    kv.py          int8 KV cache entries, one scale per (token, KV head)

The matmul kernels live with the other kernels, in ``minfer/kernels/quant_matmul.py``.
"""
_LINEAR_API = ("quantize_model", "linear_weight_bytes", "model_weight_bytes", "QUANTIZATION_METHODS")


def __getattr__(name: str):
    # Re-exported lazily: minfer.kernels.quant_matmul imports minfer.quant.weights, and linear.py
    # imports those kernels, so importing linear.py here eagerly would make a cycle.
    if name in _LINEAR_API:
        from minfer.quant import linear
        return getattr(linear, name)
    raise AttributeError(f"module 'minfer.quant' has no attribute {name!r}")
