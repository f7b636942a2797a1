"""Nf4Linear: a linear layer with NF4 weights (QLoRA's 4-bit NormalFloat, ``minfer.formats.nf4``).

    LLM("smollm2-135m", quantization="nf4")       # blocks of 64 inputs, QLoRA's choice

The matmul dequantizes the whole matrix to the activations' dtype, then multiplies: a reference
path, correct on any device but not fast (each call rebuilds the float matrix). NF4 has no
PyTorch CPU kernel, and its levels are not evenly spaced, so the int4 kernels' ``q * scale + min``
does not apply; a Triton kernel would replace that multiply-add by a 16-entry table lookup inside
the tile loop of ``minfer/kernels/quant_matmul.py``'s int4 kernel (not written: NF4 is here to be
compared with int4 on quality and bytes, not on speed).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minfer.formats.nf4 import dequantize_nf4, quantize_nf4


class Nf4Linear(nn.Module):
    """Drop-in for nn.Linear: NF4 codes ``qweight`` [out, in // 2] uint8 and ``absmax`` [out, in // block] float16."""

    def __init__(self, packed: torch.Tensor, absmax: torch.Tensor, bias: Optional[nn.Parameter]) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], packed.shape[1] * 2
        self.block_size = self.in_features // absmax.shape[1]
        self.register_buffer("qweight", packed)
        self.register_buffer("absmax", absmax)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: int) -> "Nf4Linear":
        return cls(*quantize_nf4(linear.weight.detach(), block_size), linear.bias)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight matrix this layer stands for."""
        return dequantize_nf4(self.qweight, self.absmax)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_nf4(self.qweight, self.absmax, x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4 block {self.block_size}"
