"""Host data onto the device without making the host wait for the device.

A plain copy from ordinary (pageable) host memory to a GPU, `torch.tensor(values, device="cuda")` or
`tensor.to("cuda")`, returns only once every kernel queued before it on the stream has run: the GPU's
driver cannot read pageable memory on its own schedule, so PyTorch finishes the copy on the spot. Each
step's small inputs (token ids, positions, block tables, sampling settings) would then make the host
wait for the step before, and nothing could overlap (`minfer.engine.overlap`).

Staged in pinned (page-locked) memory instead, the copy is queued like a kernel (`non_blocking=True`) and
the host goes on at once. PyTorch's pinned-memory cache keeps the staging buffer until the copy has run.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch


def to_device(data: Union[torch.Tensor, Sequence], device: Union[str, torch.device],
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`data` (a CPU tensor, or numbers / nested lists of them) as a tensor on `device`, in `dtype` if given.
    On CUDA through pinned memory, queued without waiting; elsewhere a plain copy (none on the CPU)."""
    tensor = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if torch.device(device).type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
