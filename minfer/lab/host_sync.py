"""What would make the host wait for a GPU, caught on a CPU: tests run code under these and expect nothing.

* `HostReads`: reads of tensor values into Python (`.tolist()`, `.item()`, `int()`, `bool()`, ...). On a GPU
  each waits for every kernel queued before it.
* `DeviceCopies`: minfer moving host data to a device other than through `minfer.host_copy.to_device`
  (a tensor made with a device, `.to(device)`, `.cuda()`). On a GPU such a copy from pageable memory waits
  for the stream too; `to_device` stages it in pinned memory and queues it.

On a CPU nothing waits, so the tests look for the calls themselves.
"""
from __future__ import annotations

import sys

import torch


class HostReads:
    """Counts what reads tensor values into Python while active: .tolist(), .item(), int(), float(), bool().
    `with HostReads() as reads: ...; reads.count`, and the tensors read, `reads.tensors`."""

    NAMES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy")

    def __init__(self) -> None:
        self.count, self.tensors, self.saved = 0, [], {}

    def __enter__(self):
        for name in self.NAMES:
            original = self.saved[name] = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                self.tensors.append(tensor)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


class DeviceCopies:
    """Records minfer's moves of host data to a device made outside `minfer.host_copy.to_device` (a tensor made
    with a device, `.to(device)`, `.cuda()`): `with DeviceCopies() as copies: ...; copies.outside` (where each was)."""

    def __init__(self) -> None:
        self.outside, self.saved = [], {}

    def __enter__(self):
        for owner, name in ((torch, "tensor"), (torch, "as_tensor"), (torch.Tensor, "to"), (torch.Tensor, "cuda")):
            original = self.saved[owner, name] = getattr(owner, name)

            def watched(*args, _original=original, _name=name, **kwargs):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                # (the first argument is the tensor moved, or the data made into one)
                moves = (_name == "cuda" or kwargs.get("device") is not None
                         or any(isinstance(a, (torch.device, str)) for a in args[1:]))
                if moves and caller.startswith("minfer") and caller != "minfer.host_copy":
                    self.outside.append(f"{_name} in {caller}")
                return _original(*args, **kwargs)

            setattr(owner, name, watched)
        return self

    def __exit__(self, *exc) -> None:
        for (owner, name), original in self.saved.items():
            setattr(owner, name, original)
