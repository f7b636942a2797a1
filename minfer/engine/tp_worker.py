"""What rank 0 tells the tensor-parallel workers, how it travels, and the worker that does it.

    workers.call("step", StepInputs(...))       # rank 0 (`minfer.engine.parallel`)
    Worker(model, config, dtype, device).serve()  # ranks 1..N-1: run each call until "stop"

Each message is a `Call`: the name of a `Worker` method and its arguments, small dataclasses below
(nano-vllm's pattern: the driver names the method, every rank runs it). Rank 0 pickles the call
once and broadcasts those bytes, their length first so that the workers can make room; the bytes
counted in `CommStats.broadcast_bytes` are that same pickle's. Only WORKER_METHODS can be called:
any other name is refused on rank 0, before anything is sent, and again by the worker.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from minfer.config import ModelConfig
from minfer.engine.model_runner import profile_forward
from minfer.engine.paged_kv import KVPool, PagedStep
from minfer.layers.parallel_linear import CommStats

WORKER_METHODS = ("make_pool", "profile", "step", "stop")


def check_method(method: str) -> None:
    if method not in WORKER_METHODS:
        raise ValueError(f"unknown worker method {method!r}: a tensor-parallel worker runs one of {WORKER_METHODS}")


@dataclass(frozen=True)
class Call:
    """One message: run the worker method `method` with `args`."""

    method: str
    args: tuple = ()

    def __post_init__(self) -> None:
        check_method(self.method)


@dataclass(frozen=True)
class PoolSpec:
    """The KV pool a worker makes for its own KV heads, with rank 0's block numbering."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    bucket_widths: bool  # pad groups of decodes to buckets of blocks, as rank 0 does (`minfer.engine.buckets`)


@dataclass(frozen=True)
class ProfileSize:
    """The full-size forward pass rank 0 runs to measure memory (its all-reduces need every rank)."""

    tokens: int
    max_model_len: int


@dataclass(frozen=True)
class StepInputs:
    """One step as rank 0 prepared it: the packed row of tokens, and where each sequence's KV goes."""

    input_ids: list[int]
    positions: list[int]
    num_tokens: int  # the real tokens; the row may be longer (bucket padding)
    slices: list  # each sequence's `SequenceSlice`: its tokens in the row and its block table
    use_kernels: bool


def broadcast_payload(payload: Optional[bytes], device: torch.device) -> bytes:
    """Rank 0 passes the bytes to send, the other ranks None; every rank gets the bytes back."""
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.long, device=device)
    dist.broadcast(size, src=0)
    if payload is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    else:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    dist.broadcast(data, src=0)
    return payload if payload is not None else data.cpu().numpy().tobytes()


class Channel:
    """Rank 0's end: each call pickled once, broadcast, timed and counted from that one pickle."""

    def __init__(self, device: torch.device, stats: CommStats) -> None:
        self.device, self.stats = device, stats

    def call(self, method: str, *args) -> None:
        payload = pickle.dumps(Call(method, args))  # Call refuses an unknown method before anything is sent
        start = time.perf_counter()
        broadcast_payload(payload, self.device)
        self.stats.broadcast_seconds += time.perf_counter() - start
        self.stats.broadcasts += 1
        self.stats.broadcast_bytes += len(payload)


class Worker:
    """Ranks 1..N-1: a shard of the model and its KV pool; each call from rank 0 runs one of its methods."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.config, self.dtype, self.device = model, config, dtype, device
        self.pool: Optional[KVPool] = None
        self.bucket_widths = False
        self.no_logits = torch.zeros(0, dtype=torch.long, device=device)  # only rank 0 samples
        self.running = True

    def serve(self) -> None:
        """Receive and run calls until rank 0 calls "stop"."""
        while self.running:
            self.run(pickle.loads(broadcast_payload(None, self.device)))

    def run(self, call: Call) -> None:
        check_method(call.method)  # unpickling does not run Call's own check
        getattr(self, call.method)(*call.args)

    def make_pool(self, spec: PoolSpec) -> None:
        self.pool = KVPool(self.config, spec.num_blocks, spec.block_size, self.dtype, self.device, spec.kv_cache_dtype)
        self.bucket_widths = spec.bucket_widths

    def profile(self, size: ProfileSize) -> None:
        profile_forward(self.model, size.tokens, size.max_model_len)

    def step(self, step: StepInputs) -> None:
        """The same forward pass as rank 0's, on this shard; its logits are not computed."""
        paged = PagedStep(self.pool, step.slices, torch.tensor(step.positions[:step.num_tokens]), step.use_kernels,
                          self.bucket_widths)
        self.model(torch.tensor([step.input_ids], device=self.device),
                   torch.tensor([step.positions], device=self.device), paged, logits_indices=self.no_logits)

    def stop(self) -> None:
        self.running = False
