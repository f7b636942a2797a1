"""Chapter 11: scaling out — tensor parallelism on tensor shards, the all-reduce's count, bytes and
time, and the memory each device needs.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch11")` in the
notebook.
"""
from __future__ import annotations

import torch


def column_parallel_linear(x: torch.Tensor, weight_shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """A linear split by output features: device r holds weight_shards[r] [out / N, in] and the whole x [..., in].

    Returns each device's output, x @ weight_shards[r].T [..., out / N]: a slice of the full output's
    features (concatenated in order along the last dimension, they are x @ W.T). No communication.
    """
    raise NotImplementedError("write me")


def row_parallel_linear(x_shards: list[torch.Tensor], weight_shards: list[torch.Tensor]) -> torch.Tensor:
    """A linear split by input features: device r holds x_shards[r] [..., in / N] and weight_shards[r] [out, in / N].

    Each device computes a partial sum x_shards[r] @ weight_shards[r].T [..., out]; the all-reduce
    adds them up. Returns that sum (what every device holds after the all-reduce), equal to x @ W.T.
    Raises ValueError when the two lists differ in length.
    """
    raise NotImplementedError("write me")


def all_reduce_per_token(num_layers: int, hidden_size: int, n: int, bytes_per_value: int) -> tuple[int, int, float]:
    """What tensor parallelism over n devices communicates for each token of a forward pass.

    Returns (count, payload_bytes, ring_bytes_per_device):
    - count: all-reduces per forward pass, two per layer (after o_proj and after down_proj); 0 when n == 1;
    - payload_bytes: the bytes of one token's rows in all of them: count x hidden_size x bytes_per_value;
    - ring_bytes_per_device: what each device sends for that token in a ring all-reduce, which moves
      2 (n - 1) / n of the payload out of every device (reduce-scatter, then all-gather). 0.0 when n == 1.
    Raises ValueError for n < 1.
    """
    raise NotImplementedError("write me")


def all_reduce_seconds(payload_bytes: float, n: int, link_bytes_per_s: float, latency_s: float) -> float:
    """How long one ring all-reduce takes, in seconds, in a simple cost model.

    payload_bytes: the bytes each device holds and contributes to the sum (the result has the same
    size); n: the devices in the ring; link_bytes_per_s: each device's link bandwidth in bytes per
    second, one direction (all devices send at the same time); latency_s: a fixed cost in seconds,
    charged once per all-reduce whatever its size (launching and synchronising the collective).
    The model: that fixed cost, plus the time each device needs to send its share of the ring's
    traffic over its own link. Returns seconds; 0.0 when n == 1 (nothing to exchange).
    """
    raise NotImplementedError("write me")


def weight_bytes_per_device(config, n: int, bytes_per_param: float, vocab_parallel: bool = True) -> float:
    """Bytes of weights on each of n tensor-parallel devices, for a Llama-shaped `minfer.config.ModelConfig`.

    Split n ways: q/k/v/o (with q/k/v biases if config.attention_bias) and gate/up/down of every
    layer. Replicated on every device: the RMSNorm weights (two per layer, one final, hidden_size
    each). The embedding (vocab_size x hidden_size) and, unless config.tie_word_embeddings, an
    output head of the same size: split n ways if vocab_parallel, else replicated (minfer's choice).
    """
    raise NotImplementedError("write me")


def kv_cache_bytes_per_device(config, n: int, tokens: int, bytes_per_value: float) -> float:
    """Bytes of KV cache on each of n devices for `tokens` tokens (all sequences together): K and V, every
    layer, the device's KV heads. With more devices than KV heads a head is replicated, as vLLM does:
    each device then keeps one (ceil(num_kv_heads / n) in general)."""
    raise NotImplementedError("write me")