"""Does the engine's own work per step (everything but the forward pass) stay flat as outputs grow?

    python benchmarks/bench_step_overhead.py [--batch 8] [--tokens 4096] [--update-docs]

A tiny random Llama with SmolLM2's tokenizer (2 layers, 64 wide: its forward pass is cheap)
generates --batch sequences of --tokens tokens each. Every step is timed, and so is the model
runner's share of it; what is left is the engine's bookkeeping: scheduling, block hashes, the
text of each sequence, stop checks, outputs. It is reported per step over windows of output
length: flat means each step costs the same at token 4000 as at token 100.

A second table times what it takes to turn one more token into text, side by side at several
output lengths: decoding the whole output again (what minfer did before) against the
incremental detokenizer (minfer/detokenizer.py). A third times drawing the sampled tokens of a
batch of 8 from SmolLM2's vocabulary, torch.multinomial row by row (before) against
`sample_from` (minfer/layers/sampler.py), beside a whole decode step of SmolLM2-135M at batch 8.
A fourth times the logprobs of one more streamed token on the completions endpoint at several
output lengths: its text offset summed over every earlier token (what the server did before)
against the offset the stream keeps (`StreamState`, minfer/serving/protocol.py).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from minfer import LLM, SamplingParams
from minfer.lab.bench.common import best_time, machine_info, write_docs_section
from minfer.detokenizer import IncrementalDetokenizer
from minfer.layers.sampler import sample_from
from minfer.logprobs import Logprob
from minfer.serving.protocol import completion_logprobs
from minfer.lab.testing import tiny_hf_checkpoint

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench_step_overhead:start -->", "<!-- bench_step_overhead:end -->"
WINDOW = 256  # steps per reported window


def engine_overhead_per_step(llm: LLM, batch: int, tokens: int) -> list[float]:
    """Seconds of each decode step spent outside the model runner, while `batch` sequences grow to `tokens`."""
    runner, in_runner = llm.engine.runner, [0.0]
    run = runner.run

    def timed_run(scheduled, mask_logits=None, **kwargs):
        start = time.perf_counter()
        try:
            return run(scheduled, mask_logits, **kwargs)
        finally:
            in_runner[0] += time.perf_counter() - start

    runner.run = timed_run
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True)
    for i in range(batch):
        llm.add_request(f"Sequence {i}: write whatever comes next.", params)
    overheads = []
    try:
        while llm.has_unfinished_requests():
            in_runner[0] = 0.0
            start = time.perf_counter()
            llm.step()
            overheads.append(time.perf_counter() - start - in_runner[0])
    finally:
        runner.run = run
    return overheads[1:]  # step 0 is the prefill


def text_cost_per_token(tokenizer, ids: list[int], lengths: list[int], repeats: int = 3) -> list[tuple[int, float, float]]:
    """(length, seconds to decode ids[:length] whole, seconds per token of the incremental detokenizer)."""
    rows = []
    for length in lengths:
        whole = best_time(lambda: tokenizer.decode(ids[:length], skip_special_tokens=True), repeats)

        def incremental():
            detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
            for token in ids[:length]:
                detokenizer.append(token)
        rows.append((length, whole, best_time(incremental, repeats) / length))
    return rows


def stream_logprobs_cost(tokenizer, ids: list[int], lengths: list[int], repeats: int = 3) -> list[tuple[int, float, float]]:
    """(length, seconds for the logprobs of a stream's token number `length` when its text offset is summed over the
    earlier tokens, seconds when the offset is known, as the stream keeps it)."""
    entries = [{token: Logprob(-1.0, 1, tokenizer.decode([token]))} for token in ids[:max(lengths)]]
    rows = []
    for length in lengths:
        chunk = entries[:length]

        def offset_of_last() -> int:  # the walk over every earlier entry that the server made for each chunk
            return sum(len(next(iter(e.values())).decoded_token) for e in chunk[:-1])
        offset = offset_of_last()
        rows.append((length, best_time(lambda: completion_logprobs(chunk, length - 1, offset_of_last()), repeats),
                     best_time(lambda: completion_logprobs(chunk, length - 1, offset), repeats)))
    return rows


def sampling_costs(llm: LLM, batch: int = 8, repeats: int = 20) -> tuple[float, float, float]:
    """(seconds to draw `batch` tokens with torch.multinomial row by row, with sample_from, and one
    greedy decode step of the model at that batch size); the draws the best of `repeats`, the step one run."""
    probs = torch.softmax(torch.randn(batch, llm.model.config.vocab_size, generator=torch.Generator().manual_seed(0)), -1)
    generators = [torch.Generator().manual_seed(i) for i in range(batch)]
    multinomial = best_time(lambda: [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)], repeats)
    inverse = best_time(lambda: sample_from(probs, generators), repeats)
    params = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    prompts = [f"Item {i}: the first thing to know about Python is" for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)  # warm up
    steps_before = llm.engine.snapshot().steps
    seconds = best_time(lambda: llm.generate(prompts, params, use_tqdm=False), repeats=1)
    return multinomial, inverse, seconds / (llm.engine.snapshot().steps - steps_before)


def report(overheads: list[float], text_rows, sampling, logprob_rows, batch: int, tokens: int) -> str:
    lines = [f"Engine work per step outside the forward pass, {batch} sequences generating {tokens} tokens each "
             f"(mean over {WINDOW} steps):", "", "| Output tokens so far | ms per step | Per sequence |", "|---|---:|---:|"]
    windows = [(start, overheads[start:start + WINDOW]) for start in range(0, len(overheads), WINDOW)]
    shown = [windows[0], windows[len(windows) // 4], windows[len(windows) // 2], windows[-1]]
    for start, window in shown:
        ms = sum(window) / len(window) * 1e3
        lines.append(f"| {start + 1}–{start + len(window)} | {ms:.2f} | {ms / batch:.3f} |")
    first, last = (sum(w) / len(w) for w in (shown[0][1], shown[-1][1]))
    lines += ["", f"Last window / first window: **{last / first:.2f}x**.", "",
              "The text of one more token, side by side:", "",
              "| Output length | Decode the whole output again | Incremental | Ratio |", "|---:|---:|---:|---:|"]
    for length, whole, incremental in text_rows:
        lines.append(f"| {length} | {whole * 1e3:.3f} ms | {incremental * 1e3:.4f} ms | {whole / incremental:.0f}x |")
    multinomial, inverse, step = sampling
    lines += ["", "Drawing 8 sampled tokens from SmolLM2's 49,152-token vocabulary, side by side:", "",
              "| What | ms |", "|---|---:|",
              f"| `torch.multinomial`, row by row | {multinomial * 1e3:.2f} |",
              f"| `sample_from` (one uniform per row in the running sum) | {inverse * 1e3:.2f} ({multinomial / inverse:.0f}x less) |",
              f"| For scale: one decode step of SmolLM2-135M, float32, batch 8, greedy | {step * 1e3:.1f} |"]
    lines += ["", "The logprobs of one more streamed token (`/v1/completions`, `logprobs=1`), side by side:", "",
              "| Output length | Text offset summed over the earlier tokens | Offset kept by the stream | Ratio |",
              "|---:|---:|---:|---:|"]
    for length, summed, kept in logprob_rows:
        lines.append(f"| {length} | {summed * 1e3:.3f} ms | {kept * 1e3:.4f} ms | {summed / kept:.0f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--update-docs", action="store_true", help=f"write the tables into {DOCS_PAGE.name}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    real = LLM("smollm2-135m", dtype="float32", device="cpu")  # its tokenizer only
    with tempfile.TemporaryDirectory() as folder:
        tiny_hf_checkpoint(folder, real.tokenizer, max_position_embeddings=args.tokens + 64)
        tiny = LLM(folder, dtype="float32", device="cpu", max_num_seqs=args.batch,
                   num_gpu_blocks_override=args.batch * (args.tokens + 64) // 16 + args.batch)
        overheads = engine_overhead_per_step(tiny, args.batch, args.tokens)
    import pydoc_data.topics
    text = "\n".join(pydoc_data.topics.topics.values())
    ids = real.tokenizer.encode(text)[:args.tokens]
    lengths = [n for n in (128, 512, 1024, 2048, 4096, 8192) if n <= len(ids)]
    table = report(overheads, text_cost_per_token(real.tokenizer, ids, lengths), sampling_costs(real),
                   stream_logprobs_cost(real.tokenizer, ids, lengths), args.batch, args.tokens)
    info = machine_info()
    command = f"python benchmarks/bench_step_overhead.py --batch {args.batch} --tokens {args.tokens}"
    markdown = f"`{command}` ({info['cpu']}, {info['cpu_capability']}, one thread)\n\n{table}"
    print(markdown)
    if args.update_docs:
        write_docs_section(markdown, DOCS_PAGE, START, END, "## Engine work per step over long outputs")


if __name__ == "__main__":
    main()
