"""Chapter 12: where a decode step's time goes: the host, the launches, and the device (worked solutions)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def count_aten_ops(fn: Callable[[], object]) -> int:
    """Call fn() once and return how many ATen operations it dispatched (on a GPU, each one is a kernel launch).

    Count with a `TorchDispatchMode`: its `__torch_dispatch__(self, func, types, args=(), kwargs=None)` sees
    every operation; it must still run it (`func(*args, **(kwargs or {}))`) and return the result."""
    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    with Counter() as counter:
        fn()
    return counter.count


def step_time_ms(device_ms: float, host_fixed_ms: float, host_us_per_seq: float, batch: int,
                 overlap: bool = False) -> float:
    """Milliseconds one decode step takes, given the device's work (device_ms) and the host's: a fixed part
    (host_fixed_ms) plus host_us_per_seq microseconds for each of the batch's sequences.

    Without overlap the device waits for the host's work, then the host waits for the device's: the two add up.
    With overlap the host prepares the next step while the device runs this one: the slower of the two sets
    the pace."""
    host_ms = host_fixed_ms + host_us_per_seq * batch / 1000
    return max(device_ms, host_ms) if overlap else device_ms + host_ms


def host_budget_us(device_ms: float, host_fixed_ms: float, batch: int) -> float:
    """The most host microseconds per sequence that keeps an overlapped step as fast as the device alone:
    what is left of device_ms after the host's fixed part, shared by the batch (0 when nothing is left)."""
    return max(0.0, device_ms - host_fixed_ms) * 1000 / batch


def batched_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   uniforms: torch.Tensor) -> torch.Tensor:
    """One token id per row of logits [rows, vocab], every row in the same few tensor operations.

    Per-row settings, tensors [rows]: temperature (0: greedy, take the argmax), top_k (keep the k most likely,
    ties with the k-th included; 0: all), top_p (keep the smallest set of most likely tokens whose probability
    reaches top_p, always at least the top one; 1: all). The sampled rows draw by inverse transform at their
    uniform number u in [0, 1): the first token, in vocabulary order, at which the running sum of the
    filtered probabilities exceeds u times their total. No Python loop over rows: the number of operations
    must not depend on the number of rows. Returns int64 [rows]."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]  # greedy rows: any finite scale will do
    ranked, order = scaled.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranked = ranked.masked_fill(ranked < ranked.gather(1, (k - 1)[:, None]), float("-inf"))  # below the k-th
    probs = ranked.softmax(dim=-1)
    above = probs.cumsum(dim=-1) - probs  # the mass of the tokens ranked above each token
    drop = (above >= top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False
    ranked = ranked.masked_fill(drop, float("-inf"))
    kept = torch.full_like(scaled, float("-inf")).scatter(1, order, ranked).softmax(dim=-1)  # back in vocabulary order
    running = kept.cumsum(dim=-1)
    target = (uniforms[:, None] * running[:, -1:]).contiguous()
    drawn = torch.searchsorted(running, target, right=True)
    drawn = torch.minimum(drawn, torch.searchsorted(running, running[:, -1:].contiguous()))[:, 0]  # u * total rounded up
    return torch.where(greedy, logits.argmax(dim=-1), drawn)
