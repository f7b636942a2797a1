"""Chapter 01, worked: a Llama-family decoder from its parts, as plain functions on tensors.

    tokens -> embedding -> N x [ x += attention(rms_norm(x)); x += mlp(rms_norm(x)) ]
           -> rms_norm -> output head -> logits -> next token

Weights come as a dict with Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...),
as `minfer.models.loader.load_model` returns them; a linear layer's weight is [out, in].
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from minfer.config import ModelConfig


# --------------------------------------------------------------------------- normalisation

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each vector of x [..., dim] to unit root-mean-square, then multiply by weight [dim].

    Compute the mean of squares in float32 (16-bit squares lose precision), and return x's dtype.
    """
    x32 = x.float()  # squares of large activations lose precision (or overflow) in 16-bit
    rms = torch.sqrt((x32 * x32).mean(dim=-1, keepdim=True) + eps)
    return weight * (x32 / rms).to(x.dtype)


# --------------------------------------------------------------------------- rotary position embedding

def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles: positions [...] -> two tensors [..., head_dim], float32.

    Pair i (dimensions i and i + head_dim/2) turns by position x theta^(-2i/head_dim) radians,
    so both members of a pair get the same angle.
    """
    pair = torch.arange(head_dim // 2, dtype=torch.float32, device=positions.device)
    turn_per_position = theta ** (-2 * pair / head_dim)  # early pairs spin fast, late pairs slowly
    angles = positions.float()[..., None] * turn_per_position
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Split the last dimension into halves (a, b) and return (-b, a)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the angles in cos, sin [batch, seq, head_dim] (or [seq, head_dim]).

    Each pair (a, b) becomes (a cos - b sin, b cos + a sin): a 2-D rotation. Returns x's dtype.
    """
    cos, sin = cos.unsqueeze(-3).to(x.dtype), sin.unsqueeze(-3).to(x.dtype)  # one angle for all heads
    return x * cos + rotate_half(x) * sin


# --------------------------------------------------------------------------- attention

def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Grouped-query attention with the contract of `minfer.layers.attention`.

    q [batch, num_heads, q_len, head_dim]; k, v [batch, num_kv_heads, kv_len, head_dim];
    mask [batch, 1, q_len, kv_len] bool (True: may look) or None, meaning causal with the
    queries being the last q_len keys. Query head h reads KV head h // (num_heads // num_kv_heads).
    Scores are q . k / sqrt(head_dim), softmaxed over the visible keys, then used to average v.
    Returns [batch, num_heads, q_len, head_dim].
    """
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # Put each KV head's group of query heads on their own axis: K and V are broadcast, never copied.
    q = q.view(batch, num_kv_heads, group, q_len, head_dim)
    k, v = k.unsqueeze(2), v.unsqueeze(2)  # [batch, num_kv_heads, 1, kv_len, head_dim]
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)  # [batch, kv_heads, group, q_len, kv_len]
    if mask is None:
        # query i is token (kv_len - q_len + i) of the sequence: it sees every key up to itself
        query_pos = torch.arange(q_len, device=q.device)[:, None] + (kv_len - q_len)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= query_pos
    else:
        mask = mask.unsqueeze(2)  # [batch, 1, 1, q_len, kv_len]: the same for every head
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # softmax in float32 for 16-bit inputs
    return (weights @ v).reshape(batch, num_heads, q_len, head_dim)


# --------------------------------------------------------------------------- feed-forward

def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), with silu(z) = z * sigmoid(z).

    x [..., hidden]; w_gate, w_up [intermediate, hidden]; w_down [hidden, intermediate].
    """
    gate = x @ w_gate.T
    up = x @ w_up.T
    return (gate * torch.sigmoid(gate) * up) @ w_down.T  # the gate decides how much of `up` passes


# --------------------------------------------------------------------------- the whole decoder

def _linear(x: torch.Tensor, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    bias = weights.get(f"{name}.bias")  # Qwen2 has q/k/v biases, Llama none
    y = x @ weights[f"{name}.weight"].T
    return y if bias is None else y + bias


def forward(weights: dict[str, torch.Tensor], config: ModelConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab] float32 for input_ids [batch, seq]: positions 0..seq-1, causal, no cache.

    Per layer i (names under `model.layers.{i}.`): input_layernorm -> self_attn.{q,k,v}_proj ->
    RoPE on q and k -> gqa_attention -> self_attn.o_proj -> add to x; post_attention_layernorm ->
    mlp.{gate,up,down}_proj -> add to x. Then model.norm and the head: lm_head.weight, or
    model.embed_tokens.weight when config.tie_word_embeddings. A `{name}.bias`, where the
    checkpoint has one (Qwen2's q/k/v), is added after its matmul. Llama and Qwen2 only: models
    with config.qk_norm (Qwen3) or mixtures of experts are out of scope.
    """
    batch, seq = input_ids.shape
    heads, kv_heads, head_dim, eps = config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    cos, sin = rope_cos_sin(torch.arange(seq, device=input_ids.device), head_dim, config.rope_theta)

    def split_heads(t: torch.Tensor, n: int) -> torch.Tensor:  # [batch, seq, n*head_dim] -> [batch, n, seq, head_dim]
        return t.view(batch, seq, n, head_dim).transpose(1, 2)

    x = weights["model.embed_tokens.weight"][input_ids]
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        h = rms_norm(x, weights[f"{p}.input_layernorm.weight"], eps)
        q = apply_rope(split_heads(_linear(h, weights, f"{p}.self_attn.q_proj"), heads), cos, sin)
        k = apply_rope(split_heads(_linear(h, weights, f"{p}.self_attn.k_proj"), kv_heads), cos, sin)
        v = split_heads(_linear(h, weights, f"{p}.self_attn.v_proj"), kv_heads)
        attn = gqa_attention(q, k, v, None).transpose(1, 2).reshape(batch, seq, heads * head_dim)
        x = x + _linear(attn, weights, f"{p}.self_attn.o_proj")  # residual: each block adds to x
        h = rms_norm(x, weights[f"{p}.post_attention_layernorm.weight"], eps)
        x = x + swiglu_mlp(h, weights[f"{p}.mlp.gate_proj.weight"], weights[f"{p}.mlp.up_proj.weight"],
                           weights[f"{p}.mlp.down_proj.weight"])
    x = rms_norm(x, weights["model.norm.weight"], eps)
    # a tied model has no separate head: the embedding matrix maps vectors back to token scores
    head = weights["model.embed_tokens.weight"] if config.tie_word_embeddings else weights["lm_head.weight"]
    return (x @ head.T).float()


# --------------------------------------------------------------------------- picking the next token

def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row: logits [..., vocab] -> token ids [...]."""
    return logits.argmax(dim=-1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: logits [..., vocab] with every token outside the nucleus set to -inf.

    Rank tokens by probability; a token stays when the tokens ranked above it hold less than
    top_p of the probability together. So the most likely token always stays, and the kept set
    is the smallest one whose probability reaches top_p. top_p >= 1 keeps every token (a float32
    running sum over a large vocabulary reaches 1.0 before its last tokens: do not filter at all).
    """
    if top_p >= 1.0:
        return logits.clone()
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_above < top_p)
    return logits.masked_fill(~keep, float("-inf"))


def sample(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits [..., vocab] -> token ids [...].

    temperature 0 means greedy. Otherwise divide the logits by temperature, keep the top_p
    nucleus, and draw from the softmax of what is left with `generator`.
    """
    if temperature == 0:
        return greedy(logits)
    probs = torch.softmax(top_p_filter(logits / temperature, top_p), dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])  # multinomial takes one distribution per row
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
