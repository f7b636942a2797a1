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
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)  # float16 needs CPU features most machines lack


@functools.cache
def packs_here(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack weights of this dtype on this CPU. float32: everywhere. bfloat16: only
    with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; an AVX2-only CPU (e.g. AMD Zen 3) refuses, and
    F.linear, which converts as it goes, serves it there. Asked once per dtype, by trying."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES and packs_here(weight.dtype)


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward uses a prepacked copy of its weight (CPU only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiler packs weights itself ("freezing")
            return F.linear(x, self.weight, self.bias)
        # Repack when the weight changed: in place (its version), or replaced by .to() (its storage)
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_packed_key", None) != key:
            # None where oneDNN cannot pack this weight here (e.g. a packed float32 model moved to bfloat16 on AVX2)
            packable = can_pack(self.weight)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1) if packable else None  # 1: batch hint
            self._packed_key = key
        if self._packed is None or x.dtype != self.weight.dtype:  # oneDNN would refuse a mix; F.linear says why
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight behind (an opaque oneDNN tensor): rebuilt on first use."""
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state.pop("_packed_key", None)
        return state


def pack_linears(model: nn.Module) -> nn.Module:
    """Turn every plain nn.Linear of a CPU model into a PackedLinear, in place; returns the model.

    Quantized layers (not nn.Linear) and weights oneDNN cannot pack here (`packs_here`) are left as they are."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight):
                packed = PackedLinear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                packed.weight, packed.bias = child.weight, child.bias  # the same parameters: a tied head stays tied
                setattr(parent, name, packed)
    return model
