"""One build plan: which features combine, decided in one place, and one function that builds a rank's model.

    check_combinations(config, None, None, attention)                     # before loading: what the arguments alone refuse
    build = plan(config, loaded.config, loaded.quantization, attention)   # after: the rest, with the model's shape
    model = build_model(build, loaded)                                    # rank 0 and each worker alike

`plan` reads the engine arguments, the model's shape and the checkpoint's stored quantization (None for
float weights), refuses every combination minfer does not serve (`refusals`: the whole table, one row
per rule, each saying what to do instead), and resolves what the others leave open: the scheme to apply
at load and its group size, whether it needs calibration text, the shape of one rank's shard.
`build_model` follows the plan and chooses nothing: float or stored weights, quantize, carve experts,
pack for oneDNN, the all-reduces of tensor parallelism, the attention backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from minfer.config import EngineConfig, ModelConfig, allowed_group_sizes
from minfer.layers.attention import AttentionFn, get_attention_fn
from minfer.layers.linear import pack_linears
from minfer.layers.parallel_linear import CommStats, shard_model_config, shard_weights, wrap_row_parallel
from minfer.models.llama import LlamaModel
from minfer.models.loader import LoadedModel
from minfer.moe.carve import carve_model
from minfer.quant.checkpoint import build_quantized_model
from minfer.quant.linear import quantize_model, resolve_group_size
from minfer.quant.schemes import get_scheme
from minfer.texts import calibration_token_ids


@dataclass(frozen=True)
class BuildPlan:
    """What `build_model` does, every choice made: the same plan builds rank 0 and each worker."""
    model_config: ModelConfig          # one rank's shard (the whole model with tensor_parallel_size 1)
    dtype: torch.dtype
    device: torch.device               # rank 0's; worker r of a CUDA group uses cuda:r
    tensor_parallel_size: int
    stored: bool                       # the checkpoint holds quantized weights: built as stored
    quantization: Optional[str]        # the scheme applied at load (None: float, or as stored)
    group_size: Optional[int]          # resolved for grouped schemes
    calibrated: bool                   # the scheme runs the float model on the calibration text
    carve: Optional[tuple[int, int]]   # (experts, top_k): dense MLPs split into experts
    attention: Union[str, AttentionFn]


def refusals(config: EngineConfig, model: Optional[ModelConfig], stored: Optional[dict],
             attention) -> list[tuple[bool, str]]:
    """Every combination minfer refuses, as (does this configuration hit it, the message). model None: not
    loaded yet (the rows about its shape and its stored quantization wait for it)."""
    n, scheme = config.tensor_parallel_size, get_scheme(config.quantization) if config.quantization else None
    moe, carve = model is not None and bool(model.sparse_layers), config.carve_experts is not None
    method, group = (stored["method"], stored["group_size"]) if stored else (None, None)
    tp = f"tensor_parallel_size={n} does not support"
    return [
        (stored is not None and (config.quantization not in (None, method)
                                 or config.quantization_group_size not in (None, group)),
         f"the model is a {method!r} checkpoint (group size {group}): pass quantization=None or {method!r} and no "
         f"other group size, not {config.quantization!r} with {config.quantization_group_size!r}"),
        (carve and stored is not None, "carve_experts needs an unquantized model: the model is a quantized checkpoint"),
        (carve and (config.quantization is not None or n > 1),
         "carve_experts runs on an unquantized model in one process: leave quantization=None and "
         f"tensor_parallel_size=1, got {config.quantization!r} and {n!r}"),
        (carve and moe, "carve_experts needs a dense model: this one has experts already"),
        (scheme is not None and moe and stored is None,
         f"quantization={config.quantization!r} does not support mixture-of-experts models yet (minfer.models.moe)"),
        (n > 1 and config.speculative_model is not None, f"{tp} speculative decoding (speculative_model)"),
        (n > 1 and scheme is not None and scheme.calibrated,
         f"{tp} quantization={config.quantization!r} (its calibration runs the whole model; use 'int8' or 'int4')"),
        (n > 1 and stored is not None,
         f"{tp} a saved quantized checkpoint (load the float checkpoint with quantization='int8' or 'int4')"),
        (n > 1 and config.enforce_eager is False, f"{tp} enforce_eager=False (compiled decode)"),
        (n > 1 and callable(attention),
         f"{tp} an attention function (workers are separate processes: pass 'sdpa' or 'reference')"),
        (n > 1 and config.device.type == "cuda" and torch.cuda.device_count() < n,
         f"tensor_parallel_size={n} needs {n} CUDA devices, found {torch.cuda.device_count()}"),
        (n > 1 and dist.is_initialized(),
         "a tensor-parallel LLM is already running in this process: delete it first (del llm)"),
    ]


def check_combinations(config: EngineConfig, model: Optional[ModelConfig], stored_quantization: Optional[dict],
                       attention: Union[str, AttentionFn]) -> None:
    """A ValueError with the first row of `refusals` that this configuration hits."""
    for hit, message in refusals(config, model, stored_quantization, attention):
        if hit:
            raise ValueError(message)


def plan(config: EngineConfig, model: ModelConfig, stored_quantization: Optional[dict] = None,
         attention: Union[str, AttentionFn] = "sdpa") -> BuildPlan:
    """The checked plan for building `model` under `config`; a ValueError names the first combination refused."""
    n = config.tensor_parallel_size
    shard = shard_model_config(model, n)  # divisibility of heads and neurons by n; experts refused for n > 1
    check_combinations(config, model, stored_quantization, attention)
    quantization = config.quantization if stored_quantization is None else None
    scheme = get_scheme(quantization) if quantization is not None else None
    group_size = config.quantization_group_size  # int8 and fp8 refuse one (quantize_model says so)
    if scheme is not None and scheme.grouped:
        group_size = resolve_group_size(model, group_size)
        if group_size not in allowed_group_sizes(shard):
            raise ValueError(f"{quantization} group size {group_size} does not divide a shard's input sizes with "
                             f"tensor_parallel_size={n} (hidden {shard.hidden_size}, heads "
                             f"{shard.num_heads * shard.head_dim}, intermediate {shard.intermediate_size}): choose "
                             f"quantization_group_size from {allowed_group_sizes(shard)}")
    carve = (config.carve_experts, config.carve_top_k) if config.carve_experts is not None else None
    return BuildPlan(shard, config.dtype, config.device, n, stored_quantization is not None, quantization,
                     group_size, scheme is not None and scheme.calibrated, carve, attention)


def rank_device(build: BuildPlan, rank: int) -> torch.device:
    """Where rank `rank` runs: the configured device alone; in a group, cuda:rank on CUDA, else the CPU."""
    if build.tensor_parallel_size == 1:
        return build.device
    return torch.device("cuda", rank) if build.device.type == "cuda" else torch.device("cpu")


def rank_checkpoint(build: BuildPlan, loaded: LoadedModel, rank: int) -> LoadedModel:
    """What rank `rank` builds from: the whole checkpoint alone; in a group, its shard of the weights."""
    if build.tensor_parallel_size == 1:
        return loaded
    return LoadedModel(build.model_config, shard_weights(loaded.weights, rank, build.tensor_parallel_size),
                       loaded.tokenizer if rank == 0 else None, loaded.path, None, loaded.eos_token_ids)


def build_model(build: BuildPlan, loaded: LoadedModel, rank: int = 0, comm: Optional[CommStats] = None) -> LlamaModel:
    """Rank `rank`'s model as the plan says; `loaded` is `rank_checkpoint`'s (comm: where a group counts its
    all-reduces)."""
    device = rank_device(build, rank)
    if build.stored:  # a saved quantized checkpoint (minfer.quant.checkpoint): its layers as stored
        model = build_quantized_model(loaded, build.dtype, device)
    else:
        model = LlamaModel.from_weights(build.model_config, loaded.weights, build.dtype, device)
    if build.quantization is not None:
        calibration = calibration_token_ids(loaded.tokenizer) if build.calibrated else None
        quantize_model(model, build.quantization, build.group_size, calibration_token_ids=calibration)
    if build.carve is not None:  # the dense MLPs split into experts (minfer.moe.carve)
        carve_model(model, calibration_token_ids(loaded.tokenizer), *build.carve)
    if device.type == "cpu":
        pack_linears(model)  # oneDNN's layout, once: faster matmuls (minfer.layers.linear)
    if build.tensor_parallel_size > 1:
        wrap_row_parallel(model, comm if comm is not None else CommStats())
    model.attention_fn = get_attention_fn(build.attention)
    return model
