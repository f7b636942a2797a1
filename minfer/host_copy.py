"""Host data onto the device, and results back, without making the host wait for more than it needs.

A plain copy from ordinary (pageable) host memory to a GPU, `torch.tensor(values, device="cuda")` or
`tensor.to("cuda")`, returns only once every kernel queued before it on the stream has run: the GPU's
driver cannot read pageable memory on its own schedule, so PyTorch finishes the copy on the spot. Each
step's small inputs (token ids, positions, block tables, sampling settings) would then make the host
wait for the step before, and nothing could overlap (`minfer.engine.overlap`).

Staged in pinned (page-locked) memory instead, the copy is queued like a kernel (`non_blocking=True`) and
the host goes on at once. PyTorch's pinned-memory cache keeps the staging buffer until the copy has run.

The way back has the same trap. `tensor.tolist()` on a GPU tensor waits for everything queued on the stream, so
reading step n's tokens after step n + 1 was launched would wait for step n + 1 too. `to_host` queues the copy
into pinned memory right behind the kernels that make the tensor, with an event after it; `HostCopy.wait` then
waits for that event alone.
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


class HostCopy:
    """A device tensor on its way to the host (`to_host`): `wait()` returns the host tensor once it has arrived."""

    def __init__(self, host: torch.Tensor, done: Optional["torch.cuda.Event"]) -> None:
        self.host, self.done = host, done

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()  # this copy's event: the work queued after it does not count
        return self.host


def to_host(tensor: torch.Tensor) -> HostCopy:
    """Start copying `tensor` to the host behind the work queued so far, without waiting: on CUDA into pinned memory
    with an event; elsewhere a copy made now (the CPU computed the tensor already)."""
    if tensor.device.type != "cuda":
        return HostCopy(tensor.detach().clone(), None)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostCopy(host, done)
