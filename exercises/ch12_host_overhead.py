"""Chapter 12: where a decode step's time goes: the host, the launches, and the device.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch12")` in the
notebook.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (for count_aten_ops)


def count_aten_ops(fn: Callable[[], object]) -> int:
    """Call fn() once and return how many ATen operations it dispatched (on a GPU, each one is a kernel launch).

    Count with a `TorchDispatchMode`: its `__torch_dispatch__(self, func, types, args=(), kwargs=None)` sees
    every operation; it must still run it (`func(*args, **(kwargs or {}))`) and return the result."""
    raise NotImplementedError("write me")


def step_time_ms(device_ms: float, host_fixed_ms: float, host_us_per_seq: float, batch: int,
                 overlap: bool = False) -> float:
    """Milliseconds one decode step takes, given the device's work (device_ms) and the host's: a fixed part
    (host_fixed_ms) plus host_us_per_seq microseconds for each of the batch's sequences.

    Without overlap the device waits for the host's work, then the host waits for the device's: the two add up.
    With overlap the host prepares the next step while the device runs this one: the slower of the two sets
    the pace."""
    raise NotImplementedError("write me")


def host_budget_us(device_ms: float, host_fixed_ms: float, batch: int) -> float:
    """The most host microseconds per sequence that keeps an overlapped step as fast as the device alone:
    what is left of device_ms after the host's fixed part, shared by the batch (0 when nothing is left)."""
    raise NotImplementedError("write me")


def batched_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   uniforms: torch.Tensor) -> torch.Tensor:
    """One token id per row of logits [rows, vocab], every row in the same few tensor operations.

    Per-row settings, tensors [rows]: temperature (0: greedy, take the argmax), top_k (keep the k most likely,
    ties with the k-th included; 0: all), top_p (keep the smallest set of most likely tokens whose probability
    reaches top_p, always at least the top one; 1: all). The sampled rows draw by inverse transform at their
    uniform number u in [0, 1): the first token, in vocabulary order, at which the running sum of the
    filtered probabilities exceeds u times their total. No Python loop over rows: the number of operations
    must not depend on the number of rows. Returns int64 [rows]."""
    raise NotImplementedError("write me")
