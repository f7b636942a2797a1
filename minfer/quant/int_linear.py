"""Int8Linear and Int4Linear, drop-ins for nn.Linear, and which matmul runs them (``backend``).

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

from minfer.formats.weights import (dequantize_int4, dequantize_int8, pack_int4, quantize_int4_groupwise,
                                   quantize_int8_per_channel)
from minfer.kernels.quant_matmul import int4_matmul, int4_matmul_reference, int8_matmul, int8_matmul_reference
from minfer.quant.torch_ops import (dequantize_int4_cpu, int4_cpu_unsupported, int4_mm_cpu, int8_cpu_unsupported, int8_mm_cpu,
                                    pack_int4_for_cpu)

BACKENDS = ("auto", "reference", "torch", "triton")


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
