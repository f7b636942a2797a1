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
import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minfer import LLM, SamplingParams

PROMPT_LEN = 24  # tokens of each prompt (ids below the tiny vocabulary)
VOCAB = 512


class OpCounter(TorchDispatchMode):
    """Counts every ATen operation dispatched while it is active (`with OpCounter() as ops: ...; ops.count`);
    `ops.paused()` stops counting for a while (the forward pass, to count the rest alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += self.counting
        return func(*args, **(kwargs or {}))


@dataclass
class HostRow:
    batch: int
    sampling: str  # a SAMPLING key: "mixed" samples every other sequence with temperature, top-k and top-p
    step_ms: float  # median decode step, whole
    forward_ms: float  # of which the model's forward pass
    host_us_per_seq: float  # (step - forward) / batch
    ops_per_step: int  # ATen operations in one decode step
    ops_outside_forward: int  # of which outside the model's forward pass


try:  # "greedy" and "mixed" report each request once, at its end, as LLM.generate asks
    from minfer.sampling_params import RequestOutputKind

    AS_GENERATE = {"output_kind": RequestOutputKind.FINAL_ONLY}
except ImportError:  # a checkout from before output kinds (bench_host.py --baseline): generate reported every step
    AS_GENERATE = {}
# "greedy, streamed" reports an output after every step, as a stream does (LLM.stream, the server's streams)
SAMPLING = {"greedy": [SamplingParams(temperature=0.0, **AS_GENERATE)],
            "mixed": [SamplingParams(temperature=0.8, top_p=0.95, top_k=50, **AS_GENERATE),
                      SamplingParams(temperature=0.0, **AS_GENERATE)],
            "greedy, streamed": [SamplingParams(temperature=0.0)]}


def tiny_llm(folder: str, max_num_seqs: int, device: str = "cpu", **engine_args) -> LLM:
    """SmolLM2's tokenizer on a 2-layer, 64-wide Llama with a 512-token vocabulary (random weights); engine_args
    go to the LLM."""
    from minfer.models.loader import load_tokenizer
    from minfer.lab.testing import tiny_hf_checkpoint

    tokenizer = load_tokenizer("smollm2-135m")
    tiny_hf_checkpoint(folder, tokenizer, vocab_size=VOCAB, max_position_embeddings=1024)
    return LLM(folder, dtype="float32", device=device, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max(512, max_num_seqs * PROMPT_LEN), num_gpu_blocks_override=max_num_seqs * 8,
               **engine_args)


def measure(llm: LLM, batch: int, steps: int, sampling: str = "mixed", repeats: int = 3) -> HostRow:
    """Decode `batch` sequences together, with the settings of SAMPLING[sampling] in turn: `repeats` runs of `steps`
    steps each; the run with the least host time counts (other work on the machine only ever adds time)."""
    model, forward_s, counter = llm.engine.model, [0.0], [None]
    forward = model.forward

    def timed_forward(*args, **kwargs):
        ops = counter[0]
        if ops is not None:
            ops.counting = False
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            forward_s[0] += time.perf_counter() - start
            if ops is not None:
                ops.counting = True

    model.forward = timed_forward
    gen = torch.Generator().manual_seed(batch)
    kinds = [dataclasses.replace(p, max_tokens=repeats * steps + 4, ignore_eos=True) for p in SAMPLING[sampling]]
    for i in range(batch):
        ids = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
        llm.add_request({"prompt_token_ids": ids}, kinds[i % len(kinds)])
    runs = []
    try:
        while any(s.state != "running" or s.in_prefill for s in llm.engine.snapshot(detail=True).sequences):
            llm.step()  # the prefills
        with OpCounter() as whole:
            llm.step()
        with OpCounter() as outside:
            counter[0] = outside
            llm.step()
        counter[0] = None
        for _ in range(repeats):
            step_times, forward_times = [], []
            for _ in range(steps):
                forward_s[0] = 0.0
                start = time.perf_counter()
                llm.step()
                step_times.append(time.perf_counter() - start)
                forward_times.append(forward_s[0])
            host = statistics.median(s - f for s, f in zip(step_times, forward_times))
            runs.append((host, statistics.median(step_times), statistics.median(forward_times)))
    finally:
        model.forward = forward
        for request_id in llm.engine.snapshot(detail=True).request_ids:
            llm.abort_request(request_id)
    host, step, fwd = min(runs)
    return HostRow(batch, sampling, step * 1e3, fwd * 1e3, host / batch * 1e6, whole.count, outside.count)


def run_host_bench(batches: tuple[int, ...] = (1, 32, 256), steps: int = 40, device: str = "cpu") -> list[HostRow]:
    """Every batch size with greedy sequences, then with the mixed settings. On CUDA the forward pass's time is
    only its launches (the device runs behind): there the whole step of this tiny model is what the host costs."""
    with tempfile.TemporaryDirectory() as folder:
        llm = tiny_llm(folder, max(batches), device)
        measure(llm, max(batches), 4, repeats=1)  # warm-up: allocator, oneDNN primitives, first-call paths
        return [measure(llm, batch, steps, sampling) for sampling in SAMPLING for batch in batches]


def table(rows: list[HostRow]) -> str:
    lines = ["| sampling | sequences | decode step (ms) | forward pass (ms) | host µs per sequence | ATen ops per step "
             "| of which outside the forward pass | ops / ops at the fewest sequences |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if b.sampling == r.sampling).ops_per_step
        lines.append(f"| {r.sampling} | {r.batch} | {r.step_ms:.2f} | {r.forward_ms:.2f} | {r.host_us_per_seq:.1f} "
                     f"| {r.ops_per_step} | {r.ops_outside_forward} | {r.ops_per_step / base:.2f}x |")
    return "\n".join(lines)


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256], help="decoding sequences per step")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed at each batch size")
    parser.add_argument("--json", help="write the rows here")


def run_from_args(args: argparse.Namespace) -> list[HostRow]:
    """`python -m minfer bench host`: the table, and the rows as JSON with --json."""
    torch.set_num_threads(1)  # host work is single-threaded; one thread keeps the forward pass from competing
    rows = run_host_bench(tuple(args.batches), args.steps)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return rows
