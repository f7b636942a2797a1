"""Two configurations: the shape of a model (`ModelConfig`), and how the engine serves it (`EngineConfig`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from minfer.formats.hardware import auto_dtype, check_dtype_supported, check_fp8_supported
from minfer.formats.kv import check_kv_cache_dtype, kv_vector_bytes
from minfer.formats.weights import INT4_GROUP_SIZES

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
# awq, gptq: int4 with activation-aware scales (minfer.quant.awq), with GPTQ's codes (minfer.quant.gptq)
# nf4: QLoRA's 4-bit NormalFloat, an absmax per block of quantization_group_size inputs (minfer.formats.nf4)
QUANTIZATION_METHODS = ("int8", "int4", "awq", "gptq", "nf4", "fp8", "gptq_fp8")
INT4_METHODS = ("int4", "awq", "gptq")
GROUPED_METHODS = INT4_METHODS + ("nf4",)  # the methods quantization_group_size applies to
MAX_SPECULATIVE_TOKENS = 16
CPU_KV_CACHE_BYTES = 2**30  # the KV pool on CPU when no size is given
# ModelConfig.architecture -> the transformers class named in its config.json (to_hf_dict)
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v
    architecture: str = "llama"
    attention_output_bias: bool = False  # a bias on o_proj too (Qwen3 and Llama with attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE
    # Mixture of experts (minfer.models.moe): the layers in sparse_layers replace their MLP by
    # num_experts experts of moe_intermediate_size, num_experts_per_tok of them per token
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights (Mixtral, Qwen3-MoE); Qwen2-MoE: False
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sparse_layers and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}] for a model with "
                             f"sparse layers, got {self.num_experts_per_tok}")
        if any(not 0 <= i < self.num_layers for i in self.sparse_layers):
            raise ValueError(f"sparse_layers must be layer indices in [0, {self.num_layers}), got {self.sparse_layers}")

    def kv_bytes_per_token(self, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """KV cache bytes one token takes: K and V, every layer and KV head, in the cache's format
        (the model's dtype, or int8 with its scales: see `minfer.formats.kv`)."""
        return 2 * self.num_layers * self.num_kv_heads * kv_vector_bytes(self.head_dim, dtype, kv_cache_dtype)

    def to_hf_dict(self) -> dict:
        """The same shape as a transformers `config.json` (used to build the reference model)."""
        model_type = self.architecture if self.architecture in HF_CLASSES else "llama"
        return {
            "architectures": [HF_CLASSES[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            **self._hf_moe_fields(model_type),
        }

    def _hf_moe_fields(self, model_type: str) -> dict:
        """The experts in transformers' names (the inverse of minfer.models.loader.moe_fields)."""
        dense = [i for i in range(self.num_layers) if i not in self.sparse_layers]
        if model_type == "mixtral":
            if dense:
                raise ValueError(f"a Mixtral config has no dense layers, got dense layers {dense}")
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok}
        if model_type not in ("qwen2_moe", "qwen3_moe"):
            return {}
        fields = {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                  "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                  "decoder_sparse_step": 1, "mlp_only_layers": dense}
        if model_type == "qwen2_moe":
            fields.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                          qkv_bias=self.attention_bias)
        return fields


@dataclass
class EngineConfig:
    """Every argument of `LLM` and the serving engine, under vLLM's names, checked in one place.

    Model: model (a name such as 'smollm2-135m', a .gguf file or a Hugging Face directory), dtype
    ('auto' | 'float32' | 'bfloat16' | 'float16'; auto: bfloat16 on a GPU from sm_80 on, float16 on an older
    one such as a T4, float32 on CPU; see `minfer.formats.hardware`), device
    ('auto' | 'cpu' | 'cuda'), seed (for requests that bring no seed), max_model_len (the context
    window; default the model's). quantization None | 'int8' | 'int4' | 'awq' | 'gptq' | 'nf4' | 'fp8' | 'gptq_fp8' and
    quantization_group_size (int4 and nf4 only: 32, 64 or 128; see `minfer.quant.linear`).

    KV cache: block_size (tokens per block), kv_cache_dtype ('auto' = the model's dtype, 'int8', or
    'fp8' = 'fp8_e4m3', on a GPU from sm_89 on or the CPU; see `minfer.formats.kv`),
    and the pool's size: num_gpu_blocks_override (blocks, on any device), else kv_cache_memory_bytes,
    else on CUDA gpu_memory_utilization x device memory minus what is in use, on CPU 1 GiB.

    Scheduling: max_num_seqs (sequences per step), max_num_batched_tokens (tokens per step;
    default 512 with chunked prefill, max_model_len without), enable_chunked_prefill,
    enable_prefix_caching.

    Speculative decoding: speculative_model ('[ngram]', a model name or path with the target's
    tokenizer, a shipped draft such as 'smollm2-135m-draft', the EAGLE head 'smollm2-135m-eagle', a LlamaModel,
    or a `minfer.speculative.Proposer`) with num_speculative_tokens (1-16), both or neither. `from_kwargs` also
    takes vLLM's current form, speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
    "prompt_lookup_min": 1}, {"model": name_or_path, "num_speculative_tokens": k} or {"method": "eagle",
    "model": "smollm2-135m-eagle", "num_speculative_tokens": k} (n-gram sizes of its
    own become speculative_model=NgramLookup(...), which the engine turns into its proposer).

    enforce_eager: None (the default) replays decode steps as CUDA graphs on CUDA, as vLLM does
    (`minfer.engine.cuda_graphs`: a dense model on the Triton kernels), and runs every step eagerly
    elsewhere: measured on CPU, compiling costs about 30 s and gains nothing over the eager step
    (docs/benchmarks.md). False: CUDA graphs where they can record, the compiled step elsewhere and for
    mixture-of-experts models (`minfer.engine.compiled_decode`). True: every step eagerly.

    async_scheduling: schedule and launch step n + 1 before reading step n's tokens, so that the host's work
    on step n's outputs (text, stop checks, outputs) runs while the model computes (vLLM's name; off by
    default, as there; `minfer.engine.overlap`). Not with speculative decoding, structured outputs or
    tensor parallelism.

    tensor_parallel_size: split every layer over this many processes (vLLM's name; `minfer.engine.parallel`).

    carve_experts, carve_top_k: minfer's own (not vLLM's), both or neither: every dense MLP split into
    carve_experts experts of equal size, carve_top_k of them run per token (`minfer.moe.carve`, chapter 10).

    bucket_step_shapes: pad every step's token count up to a fixed size (`minfer.engine.buckets`),
    so that the matmuls meet a bounded set of shapes: no kernel compiles in a long-running decode
    loop, and memory that stays flat (minfer's own; False runs every step at its exact size).

    Construction checks what can be checked without the model; `fit_to_model` finishes the job
    once the model's shape is known. device and dtype are resolved to torch objects.
    """

    model: str = "smollm2-135m"
    dtype: Union[str, torch.dtype] = "auto"
    device: Union[str, torch.device] = "auto"
    seed: int = 0
    max_model_len: Optional[int] = None
    quantization: Optional[str] = None
    quantization_group_size: Optional[int] = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 32
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    speculative_model: Any = None
    num_speculative_tokens: Optional[int] = None
    enforce_eager: Optional[bool] = None
    async_scheduling: bool = False
    bucket_step_shapes: bool = True
    tensor_parallel_size: int = 1
    carve_experts: Optional[int] = None
    carve_top_k: Optional[int] = None

    @classmethod
    def from_kwargs(cls, caller: str, **kwargs) -> "EngineConfig":
        """EngineConfig(**kwargs), with an error for an unknown name that says who was called and what is allowed."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known - {"speculative_config"})
        if unknown:
            raise TypeError(f"{caller} got unexpected keyword arguments {unknown}; the engine arguments are "
                            f"{sorted(known | {'speculative_config'})}")
        spec = kwargs.pop("speculative_config", None)
        if spec is not None:
            if kwargs.get("speculative_model") is not None or kwargs.get("num_speculative_tokens") is not None:
                raise ValueError("give speculative_config or speculative_model with num_speculative_tokens, not both")
            kwargs.update(speculative_args(spec))
        return cls(**kwargs)

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "kv_cache_memory_bytes", "max_model_len", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and not _is_positive_int(value):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)  # "fp8_e4m3" becomes "fp8"
        if self.kv_cache_dtype == "fp8":
            check_fp8_supported(self.device)
        for name in ("bucket_step_shapes", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.enforce_eager not in (None, True, False):
            raise ValueError(f"enforce_eager must be True, False or None (choose per device), got {self.enforce_eager!r}")
        check_quantization_args(self.quantization, self.quantization_group_size)
        self._check_speculative_args()
        check_carve_args(self.carve_experts, self.carve_top_k)
        if self.async_scheduling and (self.speculative_model is not None or self.tensor_parallel_size > 1):
            raise ValueError("async_scheduling works without speculative decoding and with tensor_parallel_size=1: "
                             "a step's inputs there depend on the previous step's tokens on the host")

    def _check_speculative_args(self) -> None:
        model, k = self.speculative_model, self.num_speculative_tokens
        if (model is None) != (k is None):
            raise ValueError("speculative_model and num_speculative_tokens go together: give both (e.g. "
                             f"speculative_model='[ngram]', num_speculative_tokens=4) or neither, got {model!r} and {k!r}")
        if model is None:
            return
        if not (isinstance(model, (str, os.PathLike, torch.nn.Module, NgramLookup, EagleDraft)) or hasattr(model, "propose")):
            raise ValueError("speculative_model must be '[ngram]', a model name or path, a LlamaModel or a Proposer, "
                             f"got {type(model).__name__}")
        if not _is_positive_int(k) or k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")

    def fit_to_model(self, model_config: ModelConfig) -> None:
        """Fill in and check what depends on the model: the context window and the token budget."""
        limit = model_config.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(f"max_model_len must be an integer in [1, {limit}] for this model, got {self.max_model_len!r}")
        self.max_model_len = self.max_model_len or limit
        if self.max_num_batched_tokens is None:  # a whole prompt per step if prompts cannot be chunked
            self.max_num_batched_tokens = 512 if self.enable_chunked_prefill else self.max_model_len
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_model_len ({self.max_model_len}), or the longest prompts could never run")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field but `model` as a flag with vLLM's spelling (`max_num_seqs` -> `--max-num-seqs`).

    Booleans get both forms (`--enable-prefix-caching` / `--no-enable-prefix-caching`), except
    `--enforce-eager`, which is a switch as in vLLM. Each flag defaults to the field's default."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine arguments (minfer.config.EngineConfig, vLLM's names)")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if f.name == "enforce_eager":
            group.add_argument(flag, action="store_true", default=None, help="run every step eagerly (the default)")
        elif kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            value_types = [t for t in typing.get_args(kind) if t is not type(None)] or [kind]
            convert = next((t for t in (int, float) if t in value_types), str)
            group.add_argument(flag, type=convert, default=f.default, metavar=convert.__name__.upper(),
                               help=f"default: {f.default}")
    group.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                       help='vLLM\'s form, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (see EngineConfig)')


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments `add_engine_arguments` parsed, ready for `LLM(model, **kwargs)`."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    if getattr(args, "speculative_config", None) is not None:
        kwargs["speculative_config"] = args.speculative_config
    return kwargs


SPECULATIVE_CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def check_prompt_lookup(prompt_lookup_max, prompt_lookup_min) -> None:
    """The n-gram sizes of prompt lookup (`minfer.speculative.ngram`): integers with 1 <= min <= max."""
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (prompt_lookup_max, prompt_lookup_min)):
        raise ValueError(f"prompt_lookup_max and prompt_lookup_min must be integers, got {prompt_lookup_max!r}, "
                         f"{prompt_lookup_min!r}")
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}")


@dataclass(frozen=True)
class NgramLookup:
    """speculative_config's n-gram prompt lookup with its own sizes, as a speculative_model: the engine
    makes the `minfer.speculative.NgramProposer` from it (`minfer.speculative.make_proposer`)."""

    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        check_prompt_lookup(self.prompt_lookup_max, self.prompt_lookup_min)


@dataclass(frozen=True)
class EagleDraft:
    """speculative_config's method "eagle", as a speculative_model: `model` must be an EAGLE head, which
    `minfer.speculative.make_proposer` checks (an ordinary draft model is refused, not run as one)."""

    model: Any


def speculative_args(spec: Any) -> dict[str, Any]:
    """vLLM's speculative_config dict as minfer's speculative_model and num_speculative_tokens:
    method "ngram" (prompt lookup, with its prompt_lookup_max/min) or a draft given as "model"."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
                         f"got {spec!r}")
    unknown = sorted(set(spec) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has keys minfer does not know: {unknown}; it takes {list(SPECULATIVE_CONFIG_KEYS)}")
    if "num_speculative_tokens" not in spec:
        raise ValueError(f"speculative_config needs num_speculative_tokens (how many tokens to propose), got {spec!r}")
    method, model = spec.get("method"), spec.get("model")
    lookup = {k: spec[k] for k in ("prompt_lookup_max", "prompt_lookup_min") if k in spec}
    if method == "ngram" and model is None:
        proposer = NgramLookup(**lookup) if lookup else "[ngram]"
    elif method == "eagle" and model is not None and not lookup:
        proposer = EagleDraft(model)
    elif method in (None, "draft_model") and model is not None and not lookup:
        proposer = model  # an EAGLE head given this way still runs as one (told apart by its config)
    else:
        raise ValueError("speculative_config needs method 'ngram' (prompt lookup; prompt_lookup_max/min allowed) or a "
                         f"draft as 'model' (method 'draft_model', 'eagle' or none), got {spec!r}")
    return {"speculative_model": proposer, "num_speculative_tokens": spec.get("num_speculative_tokens")}


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda'") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not one minfer runs on: use 'auto', 'cpu' or 'cuda' (or 'cuda:N')")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}, but this torch sees no CUDA device (torch.cuda.is_available() is False): "
                         "use 'cpu', or 'auto' to take a GPU where there is one")
    return resolved


def resolve_dtype(dtype: Union[str, torch.dtype], device: torch.device) -> torch.dtype:
    if dtype == "auto":  # bfloat16 where the GPU computes in it, float16 on an older GPU; float32 on CPU, for exactness
        return auto_dtype(device)
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not one minfer runs in: use torch.float32, torch.bfloat16 or torch.float16 "
                             "(or 'auto')")
    elif dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'")
    resolved = DTYPES.get(dtype, dtype)
    check_dtype_supported(resolved, device)  # bfloat16 on a GPU older than sm_80 is refused
    return resolved


def check_carve_args(num_experts: Optional[int], top_k: Optional[int], intermediate_size: Optional[int] = None) -> None:
    """Experts carved from a dense MLP (`minfer.moe.carve`): both or neither; E >= 2 dividing the
    MLP's intermediate size (when known), 1 <= k <= E."""
    if (num_experts is None) != (top_k is None):
        raise ValueError("carve_experts and carve_top_k go together: give both (e.g. carve_experts=16, carve_top_k=4) "
                         f"or neither, got {num_experts!r} and {top_k!r}")
    if num_experts is None:
        return
    if not _is_positive_int(num_experts) or num_experts < 2:
        raise ValueError(f"carve_experts must be an integer >= 2, got {num_experts!r}")
    if intermediate_size is not None and intermediate_size % num_experts:
        raise ValueError(f"carve_experts must divide the MLP's intermediate size {intermediate_size} "
                         f"(every expert gets the same number of neurons), got {num_experts}")
    if not _is_positive_int(top_k) or top_k > num_experts:
        raise ValueError(f"carve_top_k must be an integer in [1, carve_experts={num_experts}], got {top_k!r}")


def allowed_group_sizes(config) -> list[int]:
    """The int4 group sizes that divide the input size of every quantized matrix of this model."""
    inputs = {config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size}
    return [g for g in INT4_GROUP_SIZES if all(k % g == 0 for k in inputs)]


def check_quantization_args(quantization: Optional[str], group_size: Optional[int]) -> None:
    """What can be checked before loading anything (the group size is checked against the model later)."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {quantization!r}: use one of {QUANTIZATION_METHODS} or None")
    if group_size is not None and quantization not in GROUPED_METHODS:
        raise ValueError(f"quantization_group_size applies to the int4 methods {INT4_METHODS} and 'nf4' only, "
                         f"got {group_size!r} with quantization={quantization!r}")
    if group_size is not None and (not _is_positive_int(group_size) or group_size not in INT4_GROUP_SIZES):
        raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
