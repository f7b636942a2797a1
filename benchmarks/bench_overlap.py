"""Async scheduling against the synchronous engine: time per decode step, side by side in one process.

    python benchmarks/bench_overlap.py [--device cpu|cuda] [--models tiny smollm2-135m] [--rounds 3] [--json PATH]

Each model decodes a batch of sequences (greedy, no end) in three engines made alike but for how a step
runs: synchronous; async_scheduling (step n + 1 launched before step n's tokens are read); and, on a CPU
only, async scheduling with the model run on a second thread (this benchmark's own variant, so that the
host's Python could run beside the model's operations). Rounds alternate between the engines; each keeps
its best round (other work on the machine only adds time). Tokens are compared: all three must agree.

"tiny" is the 2-layer, 64-wide model of `python -m minfer bench host`, where the host's work is most of a
step; "smollm2-135m" the real model in bfloat16, where the forward pass is.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.engine import engine as engine_module  # noqa: E402
from minfer.engine.overlap import InFlightStep, run_step  # noqa: E402
from minfer.host_copy import to_host  # noqa: E402
from minfer.lab.bench.common import machine_info  # noqa: E402
from minfer.lab.bench.host import PROMPT_LEN, VOCAB, tiny_llm  # noqa: E402

BATCHES = {"tiny": (1, 32, 256), "smollm2-135m": (1, 16)}


class ThreadedStep(InFlightStep):
    """A step whose forward pass and draws run on a worker thread: its logits and draws wait for it."""

    def __init__(self, step, draws, done: Future) -> None:
        self.step, self.draws, self.done, self.expert_load = step, draws, done, None

    logits = property(lambda self: self.done.result()[0])
    drawn = property(lambda self: self.done.result()[1])
    tokens = property(lambda self: None if self.drawn is None else to_host(self.drawn))


def threaded_launch(worker: ThreadPoolExecutor):
    """`minfer.engine.overlap.launch` with the model on `worker` (steps stay in order: one thread)."""
    run = torch.inference_mode()(run_step)  # (a mode of the thread that runs it)

    def launch(runner, batch, previous: Optional[InFlightStep]) -> ThreadedStep:
        step = runner.prepare(batch)
        draws = runner.draws(step)
        return ThreadedStep(step, draws, worker.submit(run, runner, step, draws, previous))
    return launch


def make_llm(model: str, folder: str, device: str, batch: int, async_scheduling: bool) -> LLM:
    if model == "tiny":
        return tiny_llm(folder, batch, device, async_scheduling=async_scheduling)
    return LLM(model, dtype="bfloat16", device=device, max_num_seqs=batch, num_gpu_blocks_override=batch * 8,
               async_scheduling=async_scheduling)


def decode(llm: LLM, batch: int, steps: int, launch=None) -> tuple[float, list]:
    """Median seconds per engine step over `steps` decode steps of `batch` sequences; their tokens."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    vocab = VOCAB if llm.model.config.vocab_size == VOCAB else 49152
    for _ in range(batch):
        llm.add_request({"prompt_token_ids": torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()}, params)
    original = engine_module.launch
    if launch is not None:
        engine_module.launch = launch
    try:
        for _ in range(4):  # prefills, and the first decode steps
            llm.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            llm.step()
            if llm.engine.runner.device.type == "cuda":
                torch.cuda.synchronize()  # (the last step in flight finishes within the next one anyway)
            times.append(time.perf_counter() - start)
        outputs = []
        while llm.has_unfinished_requests():
            outputs += [o for o in llm.step() if o.finished]
    finally:
        engine_module.launch = original
    return statistics.median(times), sorted(o.outputs[0].token_ids for o in outputs)


def measure(model: str, device: str, rounds: int, steps: int) -> list[dict]:
    with ThreadPoolExecutor(1) as worker:
        return [measure_batch(model, device, rounds, steps, batch, worker if device == "cpu" else None)
                for batch in BATCHES[model]]


def measure_batch(model: str, device: str, rounds: int, steps: int, batch: int,
                  worker: Optional[ThreadPoolExecutor]) -> dict:
    """One row: each engine's best median step time over `rounds` alternating rounds, and whether their tokens agree."""
    with tempfile.TemporaryDirectory() as folder:
        engines = {"synchronous": (make_llm(model, folder, device, batch, False), None),
                   "async": (make_llm(model, folder, device, batch, True), None)}
        if worker is not None:
            engines["async, model on a thread"] = (make_llm(model, folder, device, batch, True), threaded_launch(worker))
        best, tokens = {name: float("inf") for name in engines}, {}
        for _ in range(rounds):
            for name, (llm, launch) in engines.items():
                seconds, tokens[name] = decode(llm, batch, steps, launch)
                best[name] = min(best[name], seconds)
    row = {"model": model, "sequences": batch, "same_tokens": all(t == tokens["synchronous"] for t in tokens.values()),
           **{f"{name} ms": best[name] * 1e3 for name in engines}}
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    names = [k[:-3] for k in rows[0] if k.endswith(" ms")]
    lines = ["| model | sequences | " + " | ".join(f"{n} (ms per step)" for n in names) + " | "
             + " | ".join(f"synchronous / {n}" for n in names[1:]) + " | same tokens |",
             "|---|---|" + "---|" * (2 * len(names))]
    for r in rows:
        ms = [r[f"{n} ms"] for n in names]
        lines.append(f"| {r['model']} | {r['sequences']} | " + " | ".join(f"{m:.2f}" for m in ms) + " | "
                     + " | ".join(f"{ms[0] / m:.2f}x" for m in ms[1:]) + f" | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per round")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for model in args.models for row in measure(model, args.device, args.rounds, args.steps)]
    info = machine_info(args.device)
    where = info.get("gpu", f"{info['cpu']}, {info['cores']} cores")
    print(f"\n{where}, one torch thread, torch {info['torch']}, best of {args.rounds} rounds of {args.steps} steps\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
