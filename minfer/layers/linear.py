"""Linear layers on CPU with their weights prepacked for oneDNN, the library behind PyTorch's CPU matmuls.

`F.linear(x, W)` on CPU hands W to oneDNN, which first rearranges it into the blocked layout its
kernels read fastest, on every call. Doing that once, at load time, is what inference compilers
do ("freezing"); `PackedLinear` does it in eager PyTorch. Measured on SmolLM2-135M, 2 threads:
the 120 decoder matmuls plus the head run about 1.3x faster in bfloat16 and 1.5x in float32, at
one sequence and at 32 (`docs/benchmarks.md`). bfloat16 results are bit-identical to `F.linear`;
float32 ones differ in the last bits (the sums run in another order).

The price is memory: the packed copy sits beside the plain weight, which stays for whoever reads
it (quantizers, the notebooks). A weight changed in place (e.g. activation-aware scales folded into
it) is repacked before its next use: its version counter says so.

A CPU without bfloat16 instructions (AVX2 only, e.g. AMD Zen 3) must widen each bfloat16 element
to float32 before multiplying, and oneDNN will not pack bfloat16 there. F.linear's bfloat16 path
then pays that widening for every row: over SmolLM2-135M's 121 linears on one AMD EPYC core it took
73 ms for 2 rows, 143 ms for 4 and 8.9 s for 256, against 67 ms, 74 ms and 0.99 s through a float32
packed copy (`benchmarks/bench_packed_linears.py`). So there a bfloat16 weight gets a float32 packed
copy (twice its bytes), used from `WIDE_FROM_ROWS` rows on (batched decode, prefill). A single row
keeps F.linear: it reads half the bytes, 40 ms against the copy's 44.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)  # float16 needs CPU features most machines lack
WIDE_FROM_ROWS = 2  # no bf16 instructions, one AVX2 core: the float32 copy 1.11x F.linear's time at 1 row, 0.91x at 2


@functools.cache
def packs_here(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack weights of this dtype on this CPU. float32: everywhere. bfloat16: only
    with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; an AVX2-only CPU (e.g. AMD Zen 3) refuses. Asked once
    per dtype, by trying."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def packed_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a weight of `dtype` is packed and multiplied in on this CPU: its own where oneDNN packs it,
    float32 for bfloat16 where it cannot (no bfloat16 instructions to use), None where nothing is packed."""
    if dtype in PACKABLE_DTYPES and packs_here(dtype):
        return dtype
    if dtype == torch.bfloat16 and packs_here(torch.float32):
        return torch.float32
    return None


def bf16_matmuls_fast(device_type: str) -> bool:
    """Whether bfloat16 matmuls beat float32 ones here: on CUDA, and on CPUs oneDNN packs bfloat16 for (bf16 or
    AVX-512 instructions). An AVX2-only CPU widens every element to float32 inside each bfloat16 matmul, several
    times slower than float32 itself (`docs/benchmarks.md`)."""
    return device_type == "cuda" or (device_type == "cpu" and packs_here(torch.bfloat16))


def bf16_autocast(device_type: str, enabled: bool = True) -> torch.autocast:
    """Autocast to bfloat16 (training: matmuls in bfloat16, weights and updates in float32) where
    `bf16_matmuls_fast`; float32 elsewhere."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=enabled and bf16_matmuls_fast(device_type))


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and packed_dtype(weight.dtype) is not None


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward uses a prepacked copy of its weight (CPU only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiler packs weights itself ("freezing")
            return F.linear(x, self.weight, self.bias)
        # Repack when the weight changed: in place (its version), or replaced by .to() (its storage)
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_packed_key", None) != key:
            self._pack()
            self._packed_key = key
        if self._packed is None or x.dtype != self.weight.dtype:  # oneDNN would refuse a mix; F.linear says why
            return F.linear(x, self.weight, self.bias)
        if self._packed_dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        # bfloat16 on a CPU without bf16 instructions: the float32 copy, once there are enough rows to pay for widening
        if x.numel() < WIDE_FROM_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return torch.ops.mkldnn._linear_pointwise(x.float(), self._packed, bias, "none", [], "").to(x.dtype)

    def _pack(self) -> None:
        # None where this weight cannot be packed here (e.g. a packed float32 model moved to float16)
        self._packed_dtype = packed_dtype(self.weight.dtype) if self.weight.device.type == "cpu" else None
        self._packed = None if self._packed_dtype is None else torch.ops.mkldnn._reorder_linear_weight(
            self.weight.detach().to(self._packed_dtype), 1)  # 1: batch hint

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight behind (an opaque oneDNN tensor): rebuilt on first use."""
        state = self.__dict__.copy()
        for name in ("_packed", "_packed_key", "_packed_dtype"):
            state.pop(name, None)
        return state


def linear_like(layer: nn.Module, cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """A `cls` layer on the same parameters as `layer`, not copies: a tied head stays tied."""
    new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    new.weight, new.bias = layer.weight, layer.bias
    return new


def pack_linears(model: nn.Module) -> nn.Module:
    """Turn every plain nn.Linear of a CPU model into a PackedLinear, in place; returns the model.

    Quantized layers (not nn.Linear) and weights nothing is packed for here (`packed_dtype`) are left as they are."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight):
                setattr(parent, name, linear_like(child, PackedLinear))
    return model


def unpack_linears(model: nn.Module) -> nn.Module:
    """The inverse of pack_linears: every PackedLinear back to a plain nn.Linear (F.linear), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is PackedLinear:
                setattr(parent, name, linear_like(child))
    return model
