"""Fp8Linear, a drop-in for nn.Linear: e4m3 weights, one float32 scale per output channel.

Two ways to multiply (``minfer.formats.fp8`` has the format):

- **W8A8** (``backend="torch"``): the activations are quantized too, one scale per token, computed
  on the fly, and ``torch._scaled_mm`` multiplies the two fp8 matrices, accumulating in float32 and
  applying both scales to the result. On a GPU with fp8 tensor cores (sm_89 and later: RTX 40xx, L4,
  H100) this reads half the bytes of bfloat16 and does the arithmetic at twice its rate.
- **W8A16** (``backend="reference"``): the weights are widened to the activations' dtype and
  multiplied as usual. It runs anywhere (older GPUs, CPUs), keeps the activations exact, and saves
  memory but not time: the widening costs what the narrower read saves, and more on a CPU, which
  converts e4m3 in software.

``backend="auto"`` takes W8A8 on a CUDA device from sm_89 on, W8A16 elsewhere. There is no Triton
kernel for fp8 weights: ``"triton"`` is refused.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from minfer.formats.fp8 import dequantize_fp8_rows, quantize_fp8_rows
from minfer.formats.hardware import FP8_CAPABILITY, cuda_capability

FP8_BACKENDS = ("auto", "reference", "torch")


def fp8_backend(backend: str, device: torch.device) -> str:
    """"torch" (W8A8 through torch._scaled_mm) or "reference" (W8A16) for weights on ``device``."""
    if backend not in FP8_BACKENDS:
        raise ValueError(f"fp8 weights run on the backends {FP8_BACKENDS} (no Triton kernel), got {backend!r}")
    capability = cuda_capability(device)
    w8a8_here = capability is None or capability >= FP8_CAPABILITY  # a CPU runs _scaled_mm in software
    if backend == "torch" and not w8a8_here:
        raise ValueError(f"backend 'torch' multiplies in fp8, which needs a GPU of compute capability 8.9 or newer; "
                         f"this one is sm_{capability[0]}{capability[1]}: use 'auto' or 'reference' (fp8 weights "
                         "widened to the activations' dtype)")
    if backend == "auto":
        return "torch" if capability is not None and w8a8_here else "reference"
    return backend


class Fp8Linear(nn.Module):
    """qweight float8_e4m3fn [out, in], scale float32 [out]: the weight is qweight * scale[:, None]."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[nn.Parameter],
                 backend: str = "auto") -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.reshape(-1).float())
        self.bias = bias
        self.backend = fp8_backend(backend, qweight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "auto") -> "Fp8Linear":
        q, scale = quantize_fp8_rows(linear.weight.detach())
        return cls(q, scale, linear.bias, backend)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight matrix this layer stands for."""
        return dequantize_fp8_rows(self.qweight, self.scale[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "reference":
            return F.linear(x, dequantize_fp8_rows(self.qweight, self.scale[:, None], x.dtype), self.bias)
        rows = x.reshape(-1, self.in_features)
        xq, x_scale = quantize_fp8_rows(rows)  # per token, on the fly
        out = torch._scaled_mm(xq, self.qweight.t(), scale_a=x_scale, scale_b=self.scale[None, :], out_dtype=x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per channel, "
                f"{'W8A8' if self.backend == 'torch' else 'W8A16'}")
