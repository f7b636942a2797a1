"""Saved quantized checkpoints: quantize once (GPTQ takes minutes), load in seconds, bit for bit.

    python -m minfer quantize smollm2-135m --method gptq --out smollm2-gptq     # or quantize_checkpoint(...)
    llm = LLM("smollm2-135m-gptq")                                              # no recomputation

The layout (a Hugging Face folder: config.json, model.safetensors, tokenizer files)
--------------------------------------------------------------------------------
Tensors, under minfer's module names with transformers' ``model.`` prefix (the fused matrices
stay fused: ``qkv_proj`` is q, k and v stacked by rows, ``gate_up_proj`` gate and up):

- int4 matrix (methods "int4", "awq", "gptq"), e.g. ``model.layers.0.self_attn.qkv_proj``:
  ``.qweight`` uint8 [out, in / 2] (input column 2i in the low nibble, 2i + 1 in the high),
  ``.scale`` float16 [out, in / group_size], ``.minimum`` float16 [same]; the weight is
  ``q * scale + minimum`` per group of group_size consecutive inputs (``minfer.formats.weights``).
- NF4 matrix (method "nf4"): ``.qweight`` uint8 [out, in / 2] (indices into NF4's 16 levels,
  packed as int4's), ``.absmax`` float16 [out, in / group_size]; the weight is
  ``NF4_LEVELS[q] * absmax`` per block (``minfer.formats.nf4``).
- int8 matrix (method "int8", and the output head ``lm_head`` of every method):
  ``.qweight`` int8 [out, in], ``.scale`` float32 [out]; the weight is ``q * scale`` per row.
- everything else (embedding, norms, biases such as ``model.layers.0.self_attn.qkv_proj.bias``)
  in the dtype the model was quantized in.

Each scheme of ``minfer.quant.schemes`` declares its tensors (``QuantScheme.layout``); saving
writes the quantized layers' buffers, loading checks every tensor against that layout.

``config.json`` is the model's config plus::

    "quantization_config": {"quant_method": "minfer", "format_version": 1, "method": "gptq",
                            "bits": 4, "group_size": 64, "sym": false, "desc_act": false, "head": "int8"}

(int8: ``"bits": 8, "group_size": null, "sym": true``; nf4: ``"bits": 4, "sym": true``; ``"head": null``
when lm_head stayed float),
checked on load by ``minfer.models.quantization_config`` and by the method's scheme.

Why not GPTQ's layout (``qweight``/``qzeros``/``scales``/``g_idx``, read by transformers and vLLM)
--------------------------------------------------------------------------------------------------
GPTQ's format stores, per group, a float16 scale and an *integer* 4-bit zero point:
``w = (q - z) * scale``. minfer's groups store a float16 *minimum*: ``w = q * scale + minimum``.
The two grids are the same only when ``-minimum / scale`` is a whole number in 0..15, which a
group's minimum almost never is; rounding it would move every weight of the group, so the
codes GPTQ chose would no longer be the ones that minimise the error. minfer therefore writes
its own layout (``quant_method: "minfer"``), which transformers and vLLM do not read.

Exactness: the codes, scales and minimums are written and read back as they are, so the loaded
model runs the very same int4 weights. They must be in minfer's packed layout when saved:
layers repacked for PyTorch's CPU kernel (``backend="torch"``, an LLM on CPU) keep their scales in
bfloat16 and cannot be saved exactly; `quantize_checkpoint` quantizes with ``backend="reference"``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch import nn

from minfer.config import DTYPES
from minfer.models.llama import LlamaModel
from minfer.models.loader import LoadedModel, load_model, save_hf_checkpoint
from minfer.models.quantization_config import QUANT_METHOD, is_quantized_tensor
from minfer.quant.int_linear import resolve_backend
from minfer.quant.linear import quantize_model
from minfer.quant.schemes import HEAD_SCHEME, SCHEMES, QuantScheme, get_scheme
from minfer.texts import calibration_token_ids


def save_quantized(llm_or_model: Union[object, nn.Module], out_dir: str, tokenizer=None,
                   eos_token_ids: tuple[int, ...] = ()) -> str:
    """Write a quantized LLM, or a quantized LlamaModel with its tokenizer, as a checkpoint; returns out_dir.

    The model must come from `quantize_model` (which records how it was quantized), with its int4
    layers in minfer's packed layout (any backend but "torch"; see the module docstring). An LLM's
    end-of-sequence tokens go with it (generation_config.json); a bare model's are eos_token_ids.
    """
    model = llm_or_model if isinstance(llm_or_model, nn.Module) else llm_or_model.model
    tokenizer = tokenizer if isinstance(llm_or_model, nn.Module) else llm_or_model.tokenizer
    if not isinstance(llm_or_model, nn.Module):
        eos_token_ids = tuple(sorted(llm_or_model.engine.eos_token_ids))
    if tokenizer is None:
        raise ValueError("save_quantized needs the tokenizer with a bare model: save_quantized(model, out_dir, tokenizer)")
    how = getattr(model, "quantization", None)  # recorded by quantize_model
    if how is None:
        raise ValueError("this model is not quantized: quantize it first (quantize_model, or LLM(..., quantization=...))")
    scheme = get_scheme(how["method"])
    unsavable = [(prefix, why) for prefix, layer_scheme, layer in quantized_matrices(model, scheme, how["head"])
                 if (why := layer_scheme.unsavable(layer))]
    if unsavable:
        prefix, why = unsavable[0]
        raise ValueError(f"{prefix} (and {len(unsavable) - 1} more) cannot be saved: it {why}")
    _check_out_dir(out_dir)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # a float tied head is the embedding
        tensors[name if name.startswith("lm_head.") else "model." + name] = tensor
    entry = scheme.config_entry(how["group_size"], how["head"], how["desc_act"])
    save_hf_checkpoint(LoadedModel(model.config, tensors, tokenizer, out_dir, entry, tuple(eos_token_ids)), out_dir)
    return out_dir


def _check_out_dir(out_dir: str) -> None:
    folder = Path(out_dir)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())) and not _is_quantized_checkpoint(folder):
        raise ValueError(f"{out_dir!r} exists and is not an empty folder or a minfer quantized checkpoint: "
                         "choose a new folder")


def _is_quantized_checkpoint(folder: Path) -> bool:
    try:
        return json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == QUANT_METHOD
    except (OSError, ValueError, KeyError, TypeError):
        return False


def quantized_matrices(model: nn.Module, scheme: QuantScheme,
                       head: Optional[str]) -> Iterator[tuple[str, QuantScheme, nn.Module]]:
    """(checkpoint name prefix, its scheme, the layer) of every quantized matrix: each decoder layer's, then the head."""
    for i, layer in enumerate(model.layers):
        for block_name, name in layer.LINEARS:
            yield f"model.layers.{i}.{block_name}.{name}", scheme, getattr(getattr(layer, block_name), name)
    if head == "int8":
        yield "lm_head", HEAD_SCHEME, model.lm_head


def build_quantized_model(loaded: LoadedModel, dtype: torch.dtype = torch.float32,
                          device: Union[str, torch.device] = "cpu", backend: str = "auto") -> LlamaModel:
    """The model of a quantized checkpoint (`load_model` of its folder), its quantized layers as stored."""
    entry, weights = loaded.quantization, dict(loaded.weights)
    scheme = get_scheme(entry["method"])
    expected_entry = scheme.config_entry(entry["group_size"], entry["head"], entry["desc_act"])
    if entry != expected_entry:
        raise ValueError(f"{loaded.path}: a {entry['method']!r} quantization_config must read {expected_entry} "
                         f"(head 'int8' or null, desc_act true or false), got {entry}")
    model = LlamaModel.empty(loaded.config, dtype, device)
    resolve_backend(backend, torch.device(device))  # a bad backend fails before any layer is built
    for prefix, layer_scheme, float_layer in list(quantized_matrices(model, scheme, entry["head"])):
        layout = layer_scheme.layout(float_layer.out_features, float_layer.in_features, entry["group_size"])
        tensors = _stored_tensors(loaded.path, weights, prefix, layout, device)
        _replace(model, prefix, layer_scheme.load(tensors, float_layer.bias, backend))
    leftover = [name for name in weights if is_quantized_tensor(name)]
    if leftover:
        raise ValueError(f"{loaded.path}: unexpected quantized tensors {leftover[:3]} for its quantization_config")
    model.load_weights(weights)  # embedding, norms, biases
    model.quantization = {key: entry[key] for key in ("method", "group_size", "head", "desc_act")}
    return model


def _stored_tensors(path: str, weights: dict, prefix: str, layout: dict, device) -> dict[str, torch.Tensor]:
    """One matrix's tensors, popped from weights and checked against its scheme's layout."""
    try:  # copied: safetensors' tensors can start at addresses PyTorch's int8/int4 CPU kernels cannot read
        stored = {part: weights.pop(f"{prefix}.{part}").to(device, copy=True) for part in layout}
    except KeyError as exc:
        raise ValueError(f"{path}: the checkpoint is missing {exc.args[0]}") from exc
    for part, (shape, stored_dtype) in layout.items():
        tensor = stored[part]
        if tuple(tensor.shape) != shape or tensor.dtype != stored_dtype:
            raise ValueError(f"{path}: {prefix}.{part} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                             f"{stored_dtype} {shape} for this model's config and quantization_config")
    return stored


def _replace(model: nn.Module, prefix: str, layer: nn.Module) -> None:
    """Put layer where the checkpoint name prefix says (model.layers.0.mlp.down_proj, lm_head)."""
    parent_name, _, name = prefix.removeprefix("model.").rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, name, layer)


def quantize_checkpoint(model: str, method: str, out_dir: str, group_size: Optional[int] = None,
                        dtype: torch.dtype = torch.float32) -> str:
    """Load `model`, quantize it (calibration text as LLM(..., quantization=method) uses) and save it to out_dir."""
    scheme = get_scheme(method)
    _check_out_dir(out_dir)
    loaded = load_model(model, dtype)
    if loaded.quantization is not None:
        raise ValueError(f"{model!r} is already a quantized checkpoint: quantize the float model")
    net = LlamaModel.from_weights(loaded.config, loaded.weights, dtype, "cpu")
    calibration = calibration_token_ids(loaded.tokenizer) if scheme.calibrated else None
    quantize_model(net, method, group_size, backend="reference", calibration_token_ids=calibration)
    return save_quantized(net, out_dir, loaded.tokenizer, loaded.eos_token_ids)


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `python -m minfer quantize`."""
    parser.add_argument("model", help="model name, .gguf file or Hugging Face directory (the float model)")
    parser.add_argument("--method", required=True, choices=tuple(SCHEMES),
                        help="int8 per channel, int4 round-to-nearest, awq or gptq (int4 with calibration), "
                             "nf4 (4-bit NormalFloat)")
    parser.add_argument("--out", required=True, help="the folder to write (new, or a minfer checkpoint to replace)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="int4/nf4 group size (32, 64 or 128; default the largest that divides the model's sizes)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="the dtype to quantize in, and of the float tensors saved (default float32)")


def run_quantize(args: argparse.Namespace) -> int:
    """`python -m minfer quantize`: write the checkpoint, say where and how big; 2 on bad arguments."""
    try:
        out = quantize_checkpoint(args.model, args.method, args.out, args.group_size, DTYPES[args.dtype])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    print(f"wrote {out} ({args.method}, {size / 1e6:.1f} MB of tensors): load it with LLM({out!r})")
    return 0
