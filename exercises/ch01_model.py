"""Chapter 01: a Llama-family decoder from its parts, as plain functions on tensors.

    tokens -> embedding -> N x [ x += attention(rms_norm(x)); x += mlp(rms_norm(x)) ]
           -> rms_norm -> output head -> logits -> next token

Fill in each function (replace `raise NotImplementedError`), then run `check("ch01")` in the
notebook. Weights come as a dict with Hugging Face names (`model.layers.0.self_attn.q_proj.weight`,
...), as `minfer.models.loader.load_model` returns them; a linear layer's weight is [out, in],
so the layer computes x @ weight.T.
"""
from __future__ import annotations

from typing import Optional

import torch

from minfer.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each vector of x [..., dim] to unit root-mean-square, then multiply by weight [dim].

    Compute the mean of squares in float32 (16-bit squares lose precision), and return x's dtype.
    """
    raise NotImplementedError("write me")


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles: positions [...] -> two tensors [..., head_dim], float32.

    Pair i (dimensions i and i + head_dim/2) turns by position x theta^(-2i/head_dim) radians,
    so both members of a pair get the same angle.
    """
    raise NotImplementedError("write me")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Split the last dimension into halves (a, b) and return (-b, a)."""
    raise NotImplementedError("write me")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the angles in cos, sin [batch, seq, head_dim] (or [seq, head_dim]).

    Each pair (a, b) becomes (a cos - b sin, b cos + a sin): a 2-D rotation. Returns x's dtype.
    """
    raise NotImplementedError("write me")


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Grouped-query attention with the contract of `minfer.layers.attention`.

    q [batch, num_heads, q_len, head_dim]; k, v [batch, num_kv_heads, kv_len, head_dim];
    mask [batch, 1, q_len, kv_len] bool (True: may look) or None, meaning causal with the
    queries being the last q_len keys. Query head h reads KV head h // (num_heads // num_kv_heads).
    Scores are q . k / sqrt(head_dim), softmaxed over the visible keys, then used to average v.
    Returns [batch, num_heads, q_len, head_dim].
    """
    raise NotImplementedError("write me")


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with silu(z) = z * sigmoid(z).

    x [..., hidden]; w_gate, w_up [intermediate, hidden]; w_down [hidden, intermediate].
    """
    raise NotImplementedError("write me")


def forward(weights: dict[str, torch.Tensor], config: ModelConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] float32 for input_ids [batch, seq]: positions 0..seq-1, causal, no cache.

    Per layer i (names under `model.layers.{i}.`): input_layernorm -> self_attn.{q,k,v}_proj ->
    RoPE on q and k -> gqa_attention -> self_attn.o_proj -> add to x; post_attention_layernorm ->
    mlp.{gate,up,down}_proj -> add to x. Then model.norm and the head: lm_head.weight, or
    model.embed_tokens.weight when config.tie_word_embeddings. A `{name}.bias`, where the
    checkpoint has one (Qwen2's q/k/v), is added after its matmul. Llama and Qwen2 only: models
    with config.qk_norm (Qwen3) or mixtures of experts are out of scope.
    """
    raise NotImplementedError("write me")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row: logits [..., vocab] -> token ids [...]."""
    raise NotImplementedError("write me")


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: logits [..., vocab] with every token outside the nucleus set to -inf.

    Rank tokens by probability; a token stays when the tokens ranked above it hold less than
    top_p of the probability together. So the most likely token always stays, and the kept set
    is the smallest one whose probability reaches top_p. top_p >= 1 keeps every token (a float32
    running sum over a large vocabulary reaches 1.0 before its last tokens: do not filter at all).
    """
    raise NotImplementedError("write me")


def sample(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits [..., vocab] -> token ids [...].

    temperature 0 means greedy. Otherwise divide the logits by temperature, keep the top_p
    nucleus, and draw from the softmax of what is left with `generator`.
    """
    raise NotImplementedError("write me")
