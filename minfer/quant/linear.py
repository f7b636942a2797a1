"""Quantized linear layers, and `quantize_model`, which puts them into a loaded model in place.

    model = LlamaModel.from_weights(...)
    quantize_model(model, "int4", group_size=64)     # or LLM("smollm2-135m", quantization="int4")

``"awq"`` is int4 too, after activation-aware scales are folded into the float model
(``minfer.quant.awq``), and so is ``"gptq"``, whose codes make up for each other's rounding errors
(``minfer.quant.gptq``): same format, same kernels, less error.

What gets quantized
-------------------
The four matrices of every decoder layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) in the chosen format, and the output head ``lm_head`` in int8 for both formats:
the head's errors land directly on the logits, and llama.cpp's 4-bit formats keep it at higher
precision for the same reason. The embedding table stays exact: a step reads one row of it per
token, so its size costs memory but no bandwidth. In a tied model (SmolLM2) the head is then a
separate int8 copy of the embedding matrix: memory grows by that copy (49152 x 576 bytes, 28 MB)
while every decode step reads 28 MB instead of 57 MB (bfloat16) or 113 MB (float32) for the head.

Which matmul runs (``backend``)
-------------------------------
- ``"reference"``: dequantize the whole matrix, then matmul (``minfer.kernels.quant_matmul``).
- ``"torch"``: PyTorch's own CPU kernels (``minfer.quant.torch_ops``), bfloat16 activations.
- ``"triton"``: our kernels that dequantize tile by tile inside the matmul (CUDA).
- ``"auto"`` (default): ``"triton"`` on CUDA, ``"torch"`` on CPU; a layer PyTorch's CPU kernel
  cannot take (int4: out_features not a multiple of 16; int8: in_features not a multiple of 16)
  falls back to ``"reference"`` and says why in its ``fallback_reason``.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from minfer.kernels.quant_matmul import int4_matmul, int4_matmul_reference, int8_matmul, int8_matmul_reference
from minfer.config import QUANTIZATION_METHODS, allowed_group_sizes, check_quantization_args
from minfer.quant.awq import CLIP_LINEARS, LAYER_LINEARS, apply_awq
from minfer.quant.gptq import apply_gptq
from minfer.quant.nf4 import Nf4Linear
from minfer.quant.torch_ops import (dequantize_int4_cpu, int4_cpu_unsupported, int4_mm_cpu, int8_cpu_unsupported, int8_mm_cpu,
                                    pack_int4_for_cpu)
from minfer.formats.weights import (INT4_GROUP_SIZES, dequantize_int4, dequantize_int8, pack_int4,
                                  quantize_int4_groupwise, quantize_int8_per_channel)

BACKENDS = ("auto", "reference", "torch", "triton")
CALIBRATED_METHODS = ("awq", "gptq")  # the methods that read calibration_token_ids
# How "gptq" runs, chosen by measurement (SmolLM2-135M, int4 g64, perplexity increase: plain GPTQ +16.8 %,
# with activation order +9.0 %, after AWQ's scales +8.4 %, both +6.1 %, both and AWQ's clipping +8.1 %;
# docs/benchmarks.md): after AWQ's activation-aware scales (without its clipping), in activation order.
GPTQ_AFTER_AWQ_SCALES = True
GPTQ_DESC_ACT = True


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown quantized matmul backend {backend!r}: use one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "torch" and device.type != "cpu":
        raise ValueError(f"the 'torch' backend is PyTorch's CPU kernels; the weights are on {device}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the 'triton' backend needs CUDA (or TRITON_INTERPRET=1 to interpret it on a CPU)")
    return backend


def backend_for_layer(backend: str, device: torch.device, cpu_unsupported: Optional[str]) -> tuple[str, Optional[str]]:
    """(backend, fallback_reason) for one layer: "auto" falls back to the reference where PyTorch's CPU kernel
    cannot take the layer's shape (cpu_unsupported says why); asking for "torch" there is an error."""
    resolved = resolve_backend(backend, device)
    reason = cpu_unsupported if resolved == "torch" else None
    if reason and backend == "torch":
        raise ValueError(f"backend 'torch' cannot run this layer: {reason}")
    return ("reference" if reason else resolved), reason


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear: int8 weight [out, in] and one float32 scale per output channel."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[nn.Parameter], backend: str = "auto") -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = bias
        self.backend, self.fallback_reason = backend_for_layer(backend, qweight.device,
                                                               int8_cpu_unsupported(self.in_features))

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "auto") -> "Int8Linear":
        q, scale = quantize_int8_per_channel(linear.weight.detach())
        return cls(q, scale, linear.bias, backend)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight matrix this layer stands for."""
        return dequantize_int8(self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            out = int8_mm_cpu(x, self.qweight, self.scale)
        elif self.backend == "triton":
            out = int8_matmul(x, self.qweight, self.scale)
        else:
            out = int8_matmul_reference(x, self.qweight, self.scale)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, backend={self.backend}"


class Int4Linear(nn.Module):
    """Drop-in for nn.Linear: int4 weights in groups of group_size inputs, a float16 scale and minimum each.

    Stored in our packed layout (``qweight`` [out, in // 2] uint8, ``scale`` and ``minimum``
    [out, in // group_size]), or, for the "torch" backend, repacked once into the layout of
    PyTorch's CPU kernel (``qweight`` opaque uint8, ``scale_and_zero`` [in // group_size, out, 2]).
    """

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 bias: Optional[nn.Parameter], backend: str, fallback_reason: Optional[str] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.group_size = self.in_features // scale.shape[1]
        self.backend, self.fallback_reason = backend, fallback_reason
        if backend == "torch":
            weight, scale_and_zero = pack_int4_for_cpu(packed, scale, minimum)
            self.register_buffer("qweight", weight)
            self.register_buffer("scale_and_zero", scale_and_zero)
        else:
            self.register_buffer("qweight", packed)
            self.register_buffer("scale", scale)
            self.register_buffer("minimum", minimum)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, backend: str = "auto") -> "Int4Linear":
        """Round-to-nearest int4 of the layer's weight."""
        q, scale, minimum = quantize_int4_groupwise(linear.weight.detach(), group_size)
        return cls.from_packed(pack_int4(q), scale, minimum, linear.bias, backend)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                    bias: Optional[nn.Parameter], backend: str = "auto") -> "Int4Linear":
        """A layer from codes already chosen (GPTQ, a saved checkpoint), on the backend that can run it."""
        resolved, reason = backend_for_layer(backend, packed.device, int4_cpu_unsupported(packed.shape[0]))
        return cls(packed, scale, minimum, bias, resolved, reason)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight matrix this layer stands for."""
        if self.backend == "torch":
            return dequantize_int4_cpu(self.qweight, self.scale_and_zero, self.group_size)
        return dequantize_int4(self.qweight, self.scale, self.minimum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "torch":
            out = int4_mm_cpu(x, self.qweight, self.scale_and_zero, self.group_size)
        elif self.backend == "triton":
            out = int4_matmul(x, self.qweight, self.scale, self.minimum)
        else:
            out = int4_matmul_reference(x, self.qweight, self.scale, self.minimum)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 g{self.group_size}, "
                f"backend={self.backend}")


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
    per block of group_size inputs, `minfer.quant.nf4`; the reference matmul, any backend), "awq"
    (int4 after folding activation-aware scales into the float model, `minfer.quant.awq`) or "gptq" (int4 codes chosen
    by GPTQ, `minfer.quant.gptq`; with gptq_after_awq, on the matrices after AWQ's scales; with
    gptq_desc_act, in activation order on static groups). "awq"
    and "gptq" need calibration_token_ids, e.g. `minfer.texts.calibration_token_ids(tokenizer)`.
    head: "int8" quantizes lm_head too, None keeps it.
    """
    if method is None:
        raise ValueError(f"quantize_model needs a method: one of {QUANTIZATION_METHODS}")
    check_quantization_args(method, group_size if method != "int8" else None)
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"this model is already quantized ({model.quantization['method']}): quantize the float model")
    if model.config.sparse_layers:  # the experts are stacked tensors, not the nn.Linear layers quantized here
        raise ValueError(f"quantization={method!r} does not support mixture-of-experts models yet (minfer.models.moe)")
    if head not in ("int8", None):
        raise ValueError(f"head must be 'int8' or None, got {head!r}")
    if (method in CALIBRATED_METHODS) != (calibration_token_ids is not None):
        raise ValueError(f"calibration_token_ids are needed by the methods {CALIBRATED_METHODS} and by no other, "
                         f"got {'none' if calibration_token_ids is None else 'some'} with method={method!r}")
    if method != "int8":
        group_size = resolve_group_size(model.config, group_size)
    elif group_size is not None:
        raise ValueError(f"a group size applies to int4 only; int8 has one scale per output channel (got {group_size!r})")
    codes = {}
    if method == "awq" or (method == "gptq" and gptq_after_awq):
        # before GPTQ without clipping: GPTQ's error feedback does what clipping does for round-to-nearest
        apply_awq(model, calibration_token_ids, group_size, clip_linears=() if method == "gptq" else CLIP_LINEARS)
    if method == "gptq":
        codes = apply_gptq(model, calibration_token_ids, group_size, desc_act=gptq_desc_act)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for block_name, linear_name in LAYER_LINEARS:
                block = getattr(layer, block_name)
                linear = getattr(block, linear_name)
                if method == "int8":
                    quantized = Int8Linear.from_linear(linear, backend)
                elif method == "gptq":
                    quantized = Int4Linear.from_packed(*codes[i, linear_name], linear.bias, backend)
                elif method == "nf4":
                    quantized = Nf4Linear.from_linear(linear, group_size)
                else:
                    quantized = Int4Linear.from_linear(linear, group_size, backend)
                setattr(block, linear_name, quantized)
        if head == "int8":
            model.lm_head = Int8Linear.from_linear(model.lm_head, backend)
    # how, for a saved checkpoint's config (minfer.quant.checkpoint)
    model.quantization = {"method": method, "group_size": group_size, "head": head,
                          "desc_act": method == "gptq" and gptq_desc_act}
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
               for layer in model.layers for block, name in LAYER_LINEARS)


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of everything the model stores (parameters and quantized buffers), each shared tensor once."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
