"""How much work does the host do per decode step, and does it grow with the batch?

    python -m minfer bench host [--batches 1 32 256] [--steps 40] [--json PATH] [--update-docs PATH]

On a GPU, every step of the engine is two kinds of work: the kernels the device runs, and the
Python and PyTorch dispatch that the host runs to schedule, pack, sample, detokenize and launch
them. When the host takes longer than the device, the device waits, and no kernel
optimisation shows. This harness measures the host's share with a model so small that its forward
pass costs almost nothing (SmolLM2's tokenizer, a Llama of 2 layers 64 wide and a vocabulary of
512, so that even sampling over the vocabulary is cheap), at 1, 32 and 256 decoding sequences:

* host microseconds per sequence per decode step: the whole `LLM.step` minus the model's forward
  pass, divided by the batch;
* ATen operations dispatched by one whole decode step (forward pass included), counted with
  `TorchDispatchMode`: on a GPU each is a kernel launch, whatever the machine; a count that grows
  with the batch means per-sequence work somewhere.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minfer import LLM, SamplingParams

PROMPT_LEN = 24  # tokens of each prompt (ids below the tiny vocabulary)
VOCAB = 512


class OpCounter(TorchDispatchMode):
    """Counts every ATen operation dispatched while it is active (`with OpCounter() as ops: ...; ops.count`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        name = str(func.overloadpacket)
        self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@dataclass
class HostRow:
    batch: int
    step_ms: float  # median decode step, whole
    forward_ms: float  # of which the model's forward pass
    host_us_per_seq: float  # (step - forward) / batch
    ops_per_step: int  # ATen operations in one decode step


def tiny_llm(folder: str, max_num_seqs: int) -> LLM:
    """SmolLM2's tokenizer on a 2-layer, 64-wide Llama with a 512-token vocabulary (random weights)."""
    from minfer.models.loader import load_tokenizer
    from minfer.testing import tiny_hf_checkpoint

    tokenizer = load_tokenizer("smollm2-135m")
    tiny_hf_checkpoint(folder, tokenizer, vocab_size=VOCAB, max_position_embeddings=1024)
    return LLM(folder, dtype="float32", device="cpu", max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(512, max_num_seqs * PROMPT_LEN), num_gpu_blocks_override=max_num_seqs * 8)


def measure(llm: LLM, batch: int, steps: int) -> HostRow:
    """Decode `batch` sequences together (sampled with temperature, top-p and top-k, some greedy) for `steps` steps."""
    model, forward_s = llm.engine.model, [0.0]
    forward = model.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            forward_s[0] += time.perf_counter() - start

    model.forward = timed_forward
    gen = torch.Generator().manual_seed(batch)
    kinds = [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=steps + 4, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)]
    for i in range(batch):
        ids = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
        llm.add_request({"prompt_token_ids": ids}, kinds[i % 2])
    step_times, forward_times = [], []
    try:
        while llm.engine.scheduler.waiting or any(s.num_computed < len(s.prompt_token_ids)
                                                  for s in llm.engine.scheduler.running):
            llm.step()  # the prefills
        ops = OpCounter()
        with ops:
            llm.step()
        for _ in range(steps):
            forward_s[0] = 0.0
            start = time.perf_counter()
            llm.step()
            step_times.append(time.perf_counter() - start)
            forward_times.append(forward_s[0])
    finally:
        model.forward = forward
        for request_id in list(llm.engine.requests):
            llm.abort_request(request_id)
    step, fwd = statistics.median(step_times), statistics.median(forward_times)
    host = statistics.median(s - f for s, f in zip(step_times, forward_times))
    return HostRow(batch, step * 1e3, fwd * 1e3, host / batch * 1e6, ops.count)


def run_host_bench(batches: tuple[int, ...] = (1, 32, 256), steps: int = 40) -> list[HostRow]:
    with tempfile.TemporaryDirectory() as folder:
        llm = tiny_llm(folder, max(batches))
        measure(llm, max(batches), 4)  # warm-up: allocator, oneDNN primitives, first-call paths
        return [measure(llm, batch, steps) for batch in batches]


def table(rows: list[HostRow]) -> str:
    lines = ["| sequences | decode step (ms) | forward pass (ms) | host µs per sequence | ATen ops per step | ops / ops at 1 |",
             "|---|---|---|---|---|---|"]
    base = rows[0].ops_per_step
    for r in rows:
        lines.append(f"| {r.batch} | {r.step_ms:.2f} | {r.forward_ms:.2f} | {r.host_us_per_seq:.1f} | {r.ops_per_step} "
                     f"| {r.ops_per_step / base:.2f}x |")
    return "\n".join(lines)


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256], help="decoding sequences per step")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed at each batch size")
    parser.add_argument("--json", help="write the rows here")


def run_from_args(args: argparse.Namespace, docs: Optional[callable] = None) -> list[HostRow]:
    torch.set_num_threads(1)  # host work is single-threaded; one thread keeps the forward pass from competing
    rows = run_host_bench(tuple(args.batches), args.steps)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return rows
