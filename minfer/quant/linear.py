"""`quantize_model`, which puts quantized linear layers into a loaded model in place, and byte counts.

    model = LlamaModel.from_weights(...)
    quantize_model(model, "int4", group_size=64)     # or LLM("smollm2-135m", quantization="int4")

``"awq"`` is int4 too, after activation-aware scales are folded into the float model
(``minfer.quant.awq``), and so is ``"gptq"``, whose codes make up for each other's rounding errors
(``minfer.quant.gptq``): same format, same kernels, less error.

What gets quantized
-------------------
The matrices every decoder layer declares (``DecoderLayer.LINEARS`` in ``minfer.models.llama``:
``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) in the chosen format, and the output head ``lm_head`` in int8 for both formats:
the head's errors land directly on the logits, and llama.cpp's 4-bit formats keep it at higher
precision for the same reason. The embedding table stays exact: a step reads one row of it per
token, so its size costs memory but no bandwidth. In a tied model (SmolLM2) the head is then a
separate int8 copy of the embedding matrix: memory grows by that copy (49152 x 576 bytes, 28 MB)
while every decode step reads 28 MB instead of 57 MB (bfloat16) or 113 MB (float32) for the head.

Each method is a scheme of ``minfer.quant.schemes`` (how it quantizes a matrix, what a checkpoint
stores for it); the layers themselves and the matmul each runs (``backend``) are in
``minfer.quant.int_linear`` and ``minfer.quant.nf4``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from minfer.config import allowed_group_sizes, check_quantization_args
from minfer.formats.weights import INT4_GROUP_SIZES
from minfer.quant.int_linear import BACKENDS, Int4Linear, Int8Linear, resolve_backend  # noqa: F401  (imported from here)
from minfer.quant.schemes import (CALIBRATED_METHODS, GPTQ_AFTER_AWQ_SCALES, GPTQ_DESC_ACT, HEAD_SCHEME, SCHEMES,
                                  get_scheme)

QUANTIZATION_METHODS = tuple(SCHEMES)


def resolve_group_size(config, group_size: Optional[int]) -> int:
    """None -> the largest allowed size (128 where it fits; 64 for SmolLM2's hidden size 576)."""
    allowed = allowed_group_sizes(config)
    if not allowed:
        raise ValueError(f"no int4 group size from {INT4_GROUP_SIZES} divides this model's matrix input sizes")
    if group_size is None:
        return max(allowed)
    if group_size not in allowed:
        raise ValueError(f"int4 group size must be one of {allowed} for this model (it must divide hidden_size "
                         f"{config.hidden_size} and intermediate_size {config.intermediate_size}), got {group_size!r}")
    return group_size


def quantize_model(model: nn.Module, method: str, group_size: Optional[int] = None, backend: str = "auto",
                   head: Optional[str] = "int8", calibration_token_ids: Optional[list[int]] = None,
                   gptq_after_awq: bool = GPTQ_AFTER_AWQ_SCALES, gptq_desc_act: bool = GPTQ_DESC_ACT) -> nn.Module:
    """Replace the model's linear layers with quantized ones, in place; returns the model.

    method: "int8" (per output channel), "int4" (group-wise round-to-nearest; group_size 32, 64 or
    128, default the largest that divides the model's sizes), "nf4" (QLoRA's NormalFloat, an absmax
    per block of group_size inputs, `minfer.quant.nf4`; the reference matmul, any backend), "fp8" (e4m3 per
    output channel, `minfer.quant.fp8_linear`), "awq"
    (int4 after folding activation-aware scales into the float model, `minfer.quant.awq`) or "gptq" (int4 codes chosen
    by GPTQ, `minfer.quant.gptq`; with gptq_after_awq, on the matrices after AWQ's scales; with
    gptq_desc_act, in activation order on static groups) or "gptq_fp8" (fp8 whose values GPTQ chooses). "awq",
    "gptq" and "gptq_fp8" need calibration_token_ids, e.g. `minfer.texts.calibration_token_ids(tokenizer)`.
    head: "int8" quantizes lm_head too, None keeps it.
    """
    if method is None:
        raise ValueError(f"quantize_model needs a method: one of {QUANTIZATION_METHODS}")
    scheme = get_scheme(method)
    check_quantization_args(method, group_size if scheme.grouped else None)
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"this model is already quantized ({model.quantization['method']}): quantize the float model")
    if model.config.sparse_layers:  # the experts are stacked tensors, not the nn.Linear layers quantized here
        raise ValueError(f"quantization={method!r} does not support mixture-of-experts models yet (minfer.models.moe)")
    if head not in ("int8", None):
        raise ValueError(f"head must be 'int8' or None, got {head!r}")
    if scheme.calibrated != (calibration_token_ids is not None):
        raise ValueError(f"calibration_token_ids are needed by the methods {CALIBRATED_METHODS} and by no other, "
                         f"got {'none' if calibration_token_ids is None else 'some'} with method={method!r}")
    if scheme.grouped:
        group_size = resolve_group_size(model.config, group_size)
    elif group_size is not None:
        raise ValueError(f"a group size applies to int4 only; int8 has one scale per output channel (got {group_size!r})")
    prepared = scheme.prepare(model, group_size, calibration_token_ids, gptq_after_awq=gptq_after_awq,
                              gptq_desc_act=gptq_desc_act)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for block_name, name in layer.LINEARS:
                block = getattr(layer, block_name)
                setattr(block, name, scheme.quantize(getattr(block, name), group_size, backend, prepared.codes.get((i, name))))
        if head == "int8":
            model.lm_head = HEAD_SCHEME.quantize(model.lm_head, None, backend)
    # how, for a saved checkpoint's config (minfer.quant.checkpoint)
    model.quantization = {"method": method, "group_size": group_size, "head": head, "desc_act": prepared.desc_act}
    return model


def _tensor_bytes(module: nn.Module, unquantized_dtype: Optional[torch.dtype]) -> int:
    if isinstance(module, nn.Linear):
        dtype = unquantized_dtype or module.weight.dtype
        return module.weight.numel() * dtype.itemsize
    return sum(b.numel() * b.element_size() for b in module.buffers())  # codes + scales (+ minimums)


def linear_weight_bytes(model: nn.Module, unquantized_dtype: Optional[torch.dtype] = None) -> int:
    """Bytes of the decoder layers' four weight matrices each, scales and minimums included (biases not).

    unquantized_dtype: count still-float layers as if stored in this dtype (e.g. torch.bfloat16,
    to compare with a bfloat16 model while the model itself is float32).
    """
    return sum(_tensor_bytes(getattr(getattr(layer, block), name), unquantized_dtype)
               for layer in model.layers for block, name in layer.LINEARS)


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of everything the model stores (parameters and quantized buffers), each shared tensor once."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
