"""Small models with random weights, for tests and for benchmarks on machines without the model file.

The builders, one per kind of model a test needs:

* `random_checkpoint(folder, shape)`: a Hugging Face folder of the given shape (`MODEL_SHAPES`:
  SmolLM2-135M's, or a tiny one) with a word-level tokenizer of one token per id. Needs nothing
  but the shapes, so a GPU machine without the model file can benchmark it (`python -m minfer
  bench --random-weights`), and a test subprocess can build one in a line.
* `tiny_hf_checkpoint(folder, tokenizer, "llama" | "qwen2", tie)`: a tiny transformers model
  (Llama or Qwen2, biases made to matter) saved beside a real tokenizer, usually SmolLM2's: for
  tests that compare against transformers or feed real text.
* `tiny_moe_checkpoint(folder, tokenizer, "mixtral" | "qwen2_moe" | "qwen3_moe" | "qwen3", ...)`: the same
  for the mixture-of-experts families (and dense Qwen3), routers scaled so that routing matters;
  `word_tokenizer(vocab_size)` gives it a tokenizer of the right size.
* `tiny_llama(seed)`: a tiny `LlamaModel` built in memory, no folder, no tokenizer.

The tests' shared fixtures around them live in `tests/conftest.py`.
"""
from __future__ import annotations

from typing import Union

import torch

from minfer.config import ModelConfig

# The shapes of SmolLM2-135M, of two Llama models of real size, and of a toy model of the same family (fast tests).
MODEL_SHAPES = {
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=8192, tie_word_embeddings=True),
    # two models of real size, for speed on a GPU (minfer.lab.bench.real_size): a decode step reads GBs of weights
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=131072, tie_word_embeddings=False),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=512, tie_word_embeddings=True),
}

# tiny_hf_checkpoint's shape, in transformers' names: SmolLM2's vocabulary, so its tokenizer fits.
TINY_HF = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def random_checkpoint(folder: str, shape: Union[str, ModelConfig] = "smollm2-135m", seed: int = 0) -> str:
    """Write a model of the given shape with random weights as a Hugging Face checkpoint; returns `folder`.

    For machines that have no model file (a GPU box without network): speed depends on shapes,
    not on what the weights say. A word-level tokenizer with one token per id comes with it,
    so both minfer and transformers load the folder as they would a real model.
    """
    from minfer.models.loader import LoadedModel, save_hf_checkpoint

    config = MODEL_SHAPES[shape] if isinstance(shape, str) else shape
    gen = torch.Generator().manual_seed(seed)
    h, kv, inter = config.hidden_size, config.num_kv_heads * config.head_dim, config.intermediate_size
    q = config.num_heads * config.head_dim

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen) * 0.02

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, h), "model.norm.weight": torch.ones(h)}
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = normal(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        })
        if config.attention_bias:
            weights.update({p + "self_attn.q_proj.bias": torch.zeros(q), p + "self_attn.k_proj.bias": torch.zeros(kv),
                            p + "self_attn.v_proj.bias": torch.zeros(kv)})
    save_hf_checkpoint(LoadedModel(config, weights, word_tokenizer(config.vocab_size), folder), folder)
    return folder


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token per id: '<pad>', '<s>', '</s>', then 't3', 't4', ..."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tiny_hf_checkpoint(folder, tokenizer, model_type: str = "llama", tie: bool = True, **overrides):
    """Save a tiny transformers model (`TINY_HF`, changed by `overrides`) and `tokenizer` in `folder`.

    Weights from transformers' own initialisation under seed 0 (the global generator is left as
    it was). For Qwen2 the q/k/v biases are drawn too, so that they matter. Returns the
    transformers model, for comparisons."""
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[model_type]
    config = config_class(**{**TINY_HF, **overrides}, tie_word_embeddings=tie, rope_theta=10000.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        if model_type == "qwen2":  # make the q/k/v biases matter
            with torch.no_grad():
                for layer in model.model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


# tiny_moe_checkpoint's families: transformers' config class, and the name of its expert count
MOE_FAMILIES = {"mixtral": ("MixtralConfig", "num_local_experts"), "qwen2_moe": ("Qwen2MoeConfig", "num_experts"),
                "qwen3_moe": ("Qwen3MoeConfig", "num_experts"), "qwen3": ("Qwen3Config", None)}


def tiny_moe_checkpoint(folder, tokenizer, model_type: str = "mixtral", num_experts: int = 4, top_k: int = 2,
                        router_scale: float = 50.0, **overrides):
    """Save a tiny transformers Mixtral / Qwen2-MoE / Qwen3-MoE (or dense Qwen3) and `tokenizer` in `folder`.

    `TINY_HF`'s shape with experts of 32 neurons; transformers' own initialisation under seed 0, then
    the routers' weights multiplied by router_scale, so that tokens really choose different experts
    (at the initial 0.02 scale every router logit is near 0 and the choice is a coin toss on
    rounding), and the q/k norms and biases drawn so that they matter. Returns the transformers model."""
    import transformers

    config_name, experts_key = MOE_FAMILIES[model_type]
    args = {**TINY_HF, "head_dim": 24, "rope_theta": 10000.0, "tie_word_embeddings": False}  # head_dim != hidden/heads
    if experts_key is not None:
        args.update({experts_key: num_experts, "num_experts_per_tok": top_k})
    if model_type != "mixtral" and experts_key is not None:
        args.update(moe_intermediate_size=32, norm_topk_prob=model_type == "qwen3_moe")
    if model_type == "qwen2_moe":
        args.update(shared_expert_intermediate_size=48)
    config = getattr(transformers, config_name)(**{**args, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                    p.mul_(router_scale)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
                elif name.endswith("bias") or name.endswith("shared_expert_gate.weight"):
                    p.normal_(0, 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def tiny_llama(seed: int = 0):
    """A tiny `LlamaModel` (vocabulary 64, 3 layers, tied head) with PyTorch's default random init under `seed`."""
    from minfer.models.llama import LlamaModel

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=64, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaModel(config).eval()
