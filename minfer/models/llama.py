"""A Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3) in plain PyTorch, readable top to bottom.

    tokens -> embedding -> N x [ RMSNorm -> attention -> +residual -> RMSNorm -> SwiGLU MLP -> +residual ]
           -> RMSNorm -> output head -> logits

Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) are the same decoder with a sparse
block in place of the MLP in some layers (`minfer.models.moe`).

Two choices made for speed, as vLLM makes them: q/k/v are one matrix (`qkv_proj`) and so are
gate/up (`gate_up_proj`), so a step makes 4 matmuls per layer instead of 7. `load_weights`
stacks the separate checkpoint matrices into them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minfer.config import ModelConfig
from minfer.layers.attention import AttentionCache, AttentionFn, attention_sdpa
from minfer.models.moe import SparseMoeBlock, stack_expert_weights


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: LayerNorm without the mean and the bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PyTorch's fused op computes x / sqrt(mean(x^2) + eps) in float32 and rounds once to x's
        # dtype, exactly what the written-out formula (chapter 01) gives, in one op instead of six.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE: rotate each (i, i + d/2) pair of q and k by an angle position * theta^(-2i/d).

    The dot product q.k then depends only on the distance between the two positions.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        # computed on the CPU whatever the default device (`LlamaModel.empty` builds the rest on "meta")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions [batch, seq], shaped [batch, 1, seq, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim]: the pair (x_i, x_{i+d/2}) turns by the angle of its position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_output_bias)
        if config.qk_norm:  # Qwen3: each q and k head RMS-normalised before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attention_fn: AttentionFn,
                mask: Optional[torch.Tensor], kv_cache: Optional[AttentionCache], layer: int) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = self.qkv_proj(x).view(batch, seq, self.num_heads + 2 * self.num_kv_heads, self.head_dim).transpose(1, 2)
        qk = heads[:, :self.num_heads + self.num_kv_heads]
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        rotated = apply_rope(qk, *rope)  # q and k heads in one go
        q, k = rotated.split([self.num_heads, self.num_kv_heads], dim=1)
        v = heads[:, self.num_heads + self.num_kv_heads:]
        if kv_cache is None:
            out = attention_fn(q, k, v, mask)
        else:  # the cache stores k, v where it keeps them and runs attention over all it holds
            out = kv_cache.attend(layer, q, k, v, attention_fn, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    # The layer's weight matrices, (block, name), in the order they run: what quantization replaces
    # (`minfer.quant`) and what its calibration captures the inputs of. A sparse layer's experts are
    # stacked tensors, not matrices of their own (`minfer.models.moe`).
    LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # a mixture of experts where the config says so (minfer.models.moe), a dense SwiGLU elsewhere
        self.mlp = SparseMoeBlock(config, MLP) if index in config.sparse_layers else MLP(config)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        if not self.embed_tokens.weight.is_meta:  # nn.Embedding's own init; on "meta" (`empty`) there is nothing to fill
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one matrix reads tokens in and out
        self.attention_fn: AttentionFn = attention_sdpa

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "LlamaModel":
        """Build the model and load a checkpoint, skipping the random init a checkpoint overwrites."""
        model = cls.empty(config, dtype, device)
        model.load_weights(weights)
        return model

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> "LlamaModel":
        """The model with uninitialised weights (RoPE tables computed), ready for `load_weights`."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype).to_empty(device=device)  # allocated once, in the dtype asked for
        model.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta).to(device)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Optional[AttentionCache] = None,
                mask: Optional[torch.Tensor] = None, last_only: bool = True,
                logits_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions: [batch, seq]. Returns logits [batch, seq or 1, vocab] in float32.

        mask: see `minfer.layers.attention` (None = causal). kv_cache: any `AttentionCache`, e.g. a
        contiguous `minfer.kv_cache.KVCache` (the new tokens follow those already stored) or the
        serving engine's paged step (`minfer.engine.paged_kv.PagedStep`).
        Logits are computed for the last position only (generation needs no more), for every
        position with last_only=False, or for the positions in logits_indices.
        """
        x = self.hidden_states(input_ids, positions, kv_cache, mask)
        if logits_indices is not None:
            x = x[:, logits_indices]
        elif last_only:  # skip the big output head for positions nobody samples from
            x = x[:, -1:]
        return self.logits(x)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Optional[AttentionCache] = None,
                      mask: Optional[torch.Tensor] = None, keep_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """The last decoder layer's output [batch, seq, hidden], before the final norm: what `logits`
        turns into logits, and what an EAGLE draft head reads (`minfer.speculative.eagle`).
        keep_layers: earlier decoder layers (0-based) whose outputs come first, [batch, seq, (n + 1) x hidden]."""
        x = self.embed_tokens(input_ids)
        rope = self.rope(positions, x.dtype)  # the same angles serve every layer
        kept = []
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, rope, self.attention_fn, mask, kv_cache, i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in keep_layers:
                kept.append(x)
        if kv_cache is not None:
            kv_cache.advance(input_ids.shape[1])
        return torch.cat(kept + [x], dim=-1) if kept else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: float32 logits for pre-norm hidden states."""
        return self.lm_head(self.norm(hidden)).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, stacking q/k/v and gate/up into one matrix each."""
        stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                   "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        groups: dict[str, list] = {}
        params = dict(self.named_parameters())
        if self.config.sparse_layers:  # one matrix per expert in the checkpoint, stacked in the model
            weights = stack_expert_weights(weights, self.config.num_experts)
        expected = set(params) - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        loaded = set()
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue  # RoPE tables are computed, a tied head is the embedding
            parts = name.split(".")
            if len(parts) > 3 and parts[-2] in stacked:  # layers.0.mlp.gate_proj.weight, also in mlp.shared_expert
                target, index = stacked[parts[-2]]
                key = ".".join(parts[:-2] + [target, parts[-1]])
                groups.setdefault(key, [None] * (3 if target == "qkv_proj" else 2))[index] = tensor
                continue
            self._copy(params, name, tensor)
            loaded.add(name)
        for key, pieces in groups.items():
            if any(p is None for p in pieces):
                raise ValueError(f"checkpoint is missing part of {key}")
            self._copy(params, key, torch.cat(pieces, dim=0))
            loaded.add(key)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    @staticmethod
    def _copy(params: dict, name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        if params[name].shape != tensor.shape:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(tensor)
