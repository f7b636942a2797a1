"""Which number formats a GPU computes in, by its compute capability (sm_XY), and clear refusals for the rest.

    bfloat16   from sm_80 (A100, RTX 30xx) on. An sm_75 GPU (T4, RTX 20xx) has no bfloat16 arithmetic:
               torch emulates it there (torch.cuda.is_bf16_supported() can still say True), so such a
               GPU computes in float16, which it has tensor cores for.
    fp8 e4m3   from sm_89 (RTX 40xx, L4) and sm_90 (H100) on: Triton refuses e4m3 below sm_89
               ("type fp8e4nv not supported in this architecture"; tests/test_kernel_compile.py).
               Older GPUs keep K and V in 8 bits with kv_cache_dtype="int8" instead.

A CPU computes in every format (in software where it must), so these checks only ever refuse a CUDA device.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

BF16_CAPABILITY = (8, 0)
FP8_CAPABILITY = (8, 9)


def cuda_capability(device: Union[str, torch.device]) -> Optional[tuple[int, int]]:
    """(major, minor) of a CUDA device, e.g. (7, 5) for a T4; None for any other device."""
    device = torch.device(device)
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def _gpu(device: torch.device, capability: tuple[int, int]) -> str:
    return f"{torch.cuda.get_device_name(device)} (sm_{capability[0]}{capability[1]})"


def auto_dtype(device: Union[str, torch.device]) -> torch.dtype:
    """dtype="auto": bfloat16 on a GPU that computes in it (sm_80+), float16 on an older one, float32 on a CPU
    (for exactness)."""
    capability = cuda_capability(device)
    if capability is None:
        return torch.float32
    return torch.bfloat16 if capability >= BF16_CAPABILITY else torch.float16


def check_dtype_supported(dtype: torch.dtype, device: Union[str, torch.device]) -> None:
    """A ValueError for bfloat16 on a GPU older than sm_80, naming the GPU and what to use instead."""
    device = torch.device(device)
    capability = cuda_capability(device)
    if dtype == torch.bfloat16 and capability is not None and capability < BF16_CAPABILITY:
        raise ValueError(f"dtype bfloat16 needs a GPU of compute capability 8.0 or newer (sm_80+: A100, RTX 30xx and "
                         f"later); {_gpu(device, capability)} has no bfloat16 arithmetic: use dtype='float16', or "
                         "'auto' (float16 on this GPU)")


def check_fp8_supported(device: Union[str, torch.device], what: str = "kv_cache_dtype='fp8'") -> None:
    """A ValueError for fp8 (e4m3) K/V on a GPU older than sm_89, naming the GPU and what to use instead."""
    device = torch.device(device)
    capability = cuda_capability(device)
    if capability is not None and capability < FP8_CAPABILITY:
        raise ValueError(f"{what} (e4m3) needs a GPU of compute capability 8.9 or newer (sm_89+: RTX 40xx, L4, "
                         f"H100); {_gpu(device, capability)} cannot convert e4m3: use kv_cache_dtype='int8', which "
                         "keeps K and V in 8 bits on any GPU")
