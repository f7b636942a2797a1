"""Mixture of experts from the other side (chapter 10): experts made, not loaded.

    carve.py   experts carved out of a dense model's MLPs at load time (`LLM(..., carve_experts=16, carve_top_k=4)`)

The tiny byte-level model trained dense and as a Switch MoE is course code: `minfer/lab/tiny_moe.py`.

The sparse block of Mixtral and Qwen's MoE checkpoints is `minfer/models/moe.py`; the routing and
the expert MLP both use, `minfer/layers/moe.py`.
"""
