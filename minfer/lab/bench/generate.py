"""Decode speed, timed one way for `benchmarks/bench_generate.py`, `python -m minfer bench` and notebook 00.

Generation has two phases, and they are timed apart:

* prefill reads the whole prompt in one forward pass and yields the first token: its latency is
  TTFT (time to first token);
* decode then makes one forward pass per new token: its latency is TPOT (time per output token,
  after the first). With `batch` sequences in the batch, decode throughput is batch / TPOT.

At batch 1, a decode step multiplies one vector by every weight matrix of the model, so its speed
is bounded by how fast those weights stream in from memory, not by arithmetic. Three numbers make
that visible and are measured the same way everywhere:

* `measure_memory_bandwidth()`: what a large copy achieves (bytes read + written per second);
* `weight_bytes(model)`: the bytes of weights one decode step has to read;
* `matmul_floor(model, ...)`: the same matrix multiplications a decode step makes, on the same
  weights, with nothing around them: the speed an engine would reach with zero overhead.

Model bandwidth utilisation (MBU) = weight bytes per step / TPOT / bandwidth: the share of the
memory system a decode step keeps busy.

`time_minfer` and `time_transformers` run greedy decoding of a fixed number of tokens (EOS is
ignored) on the same token ids, after a warm-up, and report TTFT, TPOT and decode tokens/s.
`run_generate_benchmark` puts it all together (used by `python -m minfer bench` and
`benchmarks/bench_generate.py`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minfer.lab.bench.common import (StepClock, best_time, dtype_name, hf_checkpoint_for, load_transformers,
                                 machine_info, synchronize, write_docs_section)
from minfer.lab.testing import MODEL_SHAPES, random_checkpoint

TokenIds = list[int]
DOCS_START = "<!-- bench_generate:start -->"
DOCS_END = "<!-- bench_generate:end -->"
# Targets: batch-1 decode at least 0.85x the speed of the matmul floor,
# and at least 1.3x the decode speed of transformers' generate in the same dtype.
TARGET_FLOOR_FRACTION = 0.85
TARGET_VS_TRANSFORMERS = 1.3

# --------------------------------------------------------------------------- results

@dataclass
class Timing:
    """One measurement. Times in seconds; None where it does not apply (the floor has no prefill)."""

    engine: str  # "minfer", "transformers" or "matmul floor"
    dtype: str
    batch_size: int
    ttft_s: Optional[float]
    tpot_s: float
    num_output_tokens: int  # per sequence
    prompt_len: int = 0
    mbu: Optional[float] = None  # model bandwidth utilisation, filled in when the bandwidth is known
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second across the batch while decoding: batch / TPOT."""
        return self.batch_size / self.tpot_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


def model_bandwidth_utilisation(bytes_per_step: int, tpot_s: float, bandwidth: float) -> float:
    """Share of the memory bandwidth one decode step uses to read its bytes.

    Every step reads all weights once, whatever the batch size, so the step time (TPOT) is what
    counts: at batch 1 this equals weight bytes x tokens/s / bandwidth. Pass the weights alone, or
    the weights plus the K/V the step reads (`decode_kv_bytes`): at large batches the K/V can
    outweigh the weights.
    """
    return bytes_per_step / tpot_s / bandwidth


def decode_kv_bytes(kv_bytes_per_token: int, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    """K/V bytes an average decode step reads while `batch` sequences each generate `new_tokens` after their prompts.

    The prefill makes the first new token; decode step j (1 to new_tokens - 1) attends over
    prompt_tokens + j tokens per sequence, so the mean context is prompt_tokens + new_tokens / 2.
    """
    mean_context = prompt_tokens + new_tokens / 2
    return batch * mean_context * kv_bytes_per_token


# --------------------------------------------------------------------------- the hardware side

def measure_memory_bandwidth(size_mb: int = 256, repeats: int = 5, device: Union[str, torch.device] = "cpu") -> float:
    """Bytes per second a large tensor copy achieves (read + write), best of `repeats`.

    Pick `size_mb` well above the last-level cache, or the cache is what gets measured.
    """
    n = size_mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once: the first write to fresh memory is slow
    return 2 * src.nbytes / best_time(lambda: dst.copy_(src), repeats, device)


def decode_linears(model) -> list[torch.nn.Module]:
    """The linear layers one decode step runs, in order (as minfer's LlamaModel makes them)."""
    linears = []
    for layer in model.layers:
        linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return linears + [model.lm_head]


def decode_weights(model) -> list[torch.Tensor]:
    """The weight matrices one decode step multiplies by, in order."""
    return [linear.weight for linear in decode_linears(model)]


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every matrix and norm, each shared tensor once.

    The embedding table is not read in full (one row per token) unless it is also the output
    head, as in tied models like SmolLM2, where the head reads all of it.
    """
    seen, total = set(), 0
    head = model.lm_head.weight.data_ptr()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name.startswith("embed_tokens") and p.data_ptr() != head:
            continue
        total += p.numel() * p.element_size()
    return total


@torch.inference_mode()
def matmul_floor(model, batch_size: int = 1, steps: int = 32, warmup: int = 3, repeats: int = 3,
                 plain: bool = False) -> Timing:
    """Time only the matrix multiplications a decode step makes, on the model's own weights.

    By default it calls the model's own linear layers (on CPU minfer's are prepacked for oneDNN,
    `minfer.layers.linear`): nothing but the engine's overhead separates the engine from this.
    plain=True calls F.linear on the weights instead, what an engine without prepacking runs.
    Returns a Timing whose TPOT is the best step time over `repeats` runs of `steps` steps: no
    engine with these matmuls decodes faster without reading fewer bytes (an upper bound on tokens/s).
    On CUDA the step is captured once as a CUDA graph and replayed: launched one by one from Python, 121
    small matmuls take longer to launch than a GPU takes to read their weights, and the floor would time
    Python (if capture fails, they are launched one by one, as the engine launches them).
    """
    linears = decode_linears(model)
    weight = linears[0].weight
    device, dtype = weight.device, weight.dtype
    inputs = {m.in_features: torch.randn(batch_size, 1, m.in_features, dtype=dtype, device=device) for m in linears}
    calls = [(lambda x, w=m.weight: F.linear(x, w)) if plain else m for m in linears]

    @torch.inference_mode()
    def step() -> None:
        for linear, call in zip(linears, calls):
            call(inputs[linear.in_features])

    def run() -> None:
        for _ in range(steps):
            step()

    if device.type == "cuda":
        side = torch.cuda.Stream()  # warm up off the default stream, as CUDA-graph capture wants
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()

            def run() -> None:
                for _ in range(steps):
                    graph.replay()
        except RuntimeError as exc:  # something in the step cannot be captured: time the launches themselves
            print(f"matmul floor: no CUDA graph ({str(exc).splitlines()[0]}); timing eager launches")
    else:
        for _ in range(warmup):
            step()
    best = best_time(run, repeats, device) / steps
    return Timing("F.linear floor" if plain else "matmul floor", dtype_name(dtype), batch_size, None, best, steps)


# --------------------------------------------------------------------------- prompts

def make_prompts(vocab_size: int, num_prompts: int, prompt_len: int, seed: int = 0, low: int = 100) -> list[TokenIds]:
    """`num_prompts` different prompts of exactly `prompt_len` random token ids (no padding needed).

    Token ids, not text: both engines then see exactly the same input, and a model without a
    real tokenizer (random weights on a GPU machine) can be benchmarked too. Ids below `low`
    are skipped (special tokens live there).
    """
    gen = torch.Generator().manual_seed(seed)
    low = min(low, vocab_size // 2)
    return torch.randint(low, vocab_size, (num_prompts, prompt_len), generator=gen).tolist()


def _batch_of(prompts: Sequence[TokenIds], batch_size: Optional[int]) -> list[TokenIds]:
    if not prompts:
        raise ValueError("give at least one prompt")
    batch_size = batch_size or len(prompts)
    return [list(prompts[i % len(prompts)]) for i in range(batch_size)]


def _as_ids(prompt, tokenizer) -> TokenIds:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    return list(prompt)


# --------------------------------------------------------------------------- the engines

def time_minfer(llm, prompts: Sequence[Union[str, TokenIds]], max_tokens: int = 32, batch_size: Optional[int] = None,
                warmup: bool = True) -> Timing:
    """Greedy-decode exactly `max_tokens` tokens for `batch_size` prompts in one batch with minfer.

    TTFT and TPOT come from the engine's own per-request metrics (averaged over the batch).
    The generated ids are in `timing.extra["token_ids"]`.
    """
    from minfer.sampling_params import SamplingParams

    if max_tokens < 2:
        raise ValueError("max_tokens must be >= 2: TPOT needs a token after the first")
    batch = _batch_of([_as_ids(p, llm.tokenizer) for p in prompts], batch_size)
    requests = [{"prompt_token_ids": ids} for ids in batch]
    scheduler, blocks = llm.engine.scheduler, llm.engine.blocks
    saved = scheduler.max_num_seqs, blocks.enable_prefix_caching
    # The whole batch runs together, and every prompt is computed in full: with the prefix cache on,
    # the warm-up (or an earlier repeat) would leave the prompts cached and TTFT would measure nothing.
    scheduler.max_num_seqs, blocks.enable_prefix_caching = max(saved[0], len(batch)), False
    try:
        if warmup:
            llm.generate(requests, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(requests, params, use_tqdm=False)
    finally:
        scheduler.max_num_seqs, blocks.enable_prefix_caching = saved
    counts = {o.metrics.num_output_tokens for o in outputs}
    if counts != {max_tokens}:
        raise RuntimeError(f"minfer generated {sorted(counts)} tokens per sequence, expected {max_tokens}")
    ttft = statistics.mean(o.metrics.ttft for o in outputs)
    tpot = statistics.mean(o.metrics.tpot for o in outputs)
    return Timing("minfer", dtype_name(llm.dtype), len(batch), ttft, tpot, max_tokens, len(batch[0]),
                  extra={"token_ids": [o.outputs[0].token_ids for o in outputs]})


def time_transformers(hf_model, tokenizer, prompts: Sequence[Union[str, TokenIds]], max_tokens: int = 32,
                      batch_size: Optional[int] = None, warmup: bool = True) -> Timing:
    """Greedy-decode exactly `max_tokens` tokens for `batch_size` prompts with transformers' `generate`.

    A logits processor notes the time of every step, so TTFT and TPOT come from one call, defined
    as minfer defines them. EOS is switched off for the call, so both engines generate the same
    number of tokens. Prompts of different lengths are left-padded.
    """
    from transformers import LogitsProcessorList

    if max_tokens < 2:
        raise ValueError("max_tokens must be >= 2: TPOT needs a token after the first")
    batch = _batch_of([_as_ids(p, tokenizer) for p in prompts], batch_size)
    device = next(hf_model.parameters()).device
    longest = max(len(ids) for ids in batch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (longest - len(ids)) + ids for ids in batch], device=device)
    attention = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in batch], device=device)
    config = hf_model.generation_config
    saved = config.eos_token_id, config.pad_token_id
    config.eos_token_id, config.pad_token_id = None, pad
    kwargs = dict(attention_mask=attention, do_sample=False, temperature=None, top_p=None, top_k=None)
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            if warmup:
                hf_model.generate(input_ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
            clock = StepClock()
            synchronize(device)
            start = time.perf_counter()
            out = hf_model.generate(input_ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                    logits_processor=LogitsProcessorList([clock]), **kwargs)
    finally:
        config.eos_token_id, config.pad_token_id = saved
    generated = out.shape[1] - longest
    if generated != max_tokens or len(clock.times) != max_tokens:
        raise RuntimeError(f"transformers generated {generated} tokens ({len(clock.times)} steps), expected {max_tokens}")
    ttft = clock.times[0] - start
    tpot = (clock.times[-1] - clock.times[0]) / (max_tokens - 1)
    return Timing("transformers", dtype_name(hf_model.dtype), len(batch), ttft, tpot, max_tokens, longest,
                  extra={"token_ids": out[:, longest:].tolist()})


# --------------------------------------------------------------------------- the benchmark

PRESETS = {
    # tokens per sequence, repeats (best of), prompt length, floor steps
    "quick": dict(max_tokens=16, repeats=1, prompt_len=32, floor_steps=8),
    "full": dict(max_tokens=48, repeats=3, prompt_len=64, floor_steps=24),
}


def run_generate_benchmark(model: str = "smollm2-135m", dtypes: Sequence[str] = ("float32", "bfloat16"),
                           batch_sizes: Sequence[int] = (1, 16), max_tokens: int = 48, prompt_len: int = 64,
                           repeats: int = 3, floor_steps: int = 24, device: str = "cpu",
                           engines: Sequence[str] = ("minfer", "transformers"), progress: bool = True,
                           random_weights: Optional[str] = None, bandwidth_mb: int = 256) -> dict:
    """minfer vs transformers generate vs the matmul floor, same weights, same prompts, one process.

    For every dtype and batch size the three are timed in turn, `repeats` times, and the best of
    each is kept (interference from other processes only ever adds time). Returns a JSON-able dict.
    """
    from minfer.llm import LLM

    unknown = set(engines) - {"minfer", "transformers"}
    if unknown:
        raise ValueError(f"unknown engines {sorted(unknown)}: use minfer and/or transformers")
    started = time.perf_counter()
    machine = machine_info(device)  # before we load the machine ourselves
    tasks = len(dtypes) * len(batch_sizes) * repeats * (2 + len(engines)) + 1
    bar = tqdm(total=tasks, desc="bench", disable=not progress, leave=False)
    with tempfile.TemporaryDirectory(prefix="minfer_bench_") as tmp:
        bar.set_postfix_str("preparing weights")
        if random_weights:
            folder = random_checkpoint(tmp, random_weights)
        else:
            folder = hf_checkpoint_for(model, tmp)
        bar.set_postfix_str("memory bandwidth")
        # a GPU copies 256 MB in about 0.1 ms, too short to time well: 2 GB there
        bandwidth = measure_memory_bandwidth(bandwidth_mb if torch.device(device).type == "cpu" else max(bandwidth_mb, 2048),
                                             device=device)
        bar.update()
        rows: list[Timing] = []
        per_step_bytes = {}
        for dtype in dtypes:
            bar.set_postfix_str(f"loading {dtype}")
            llm = LLM(folder, dtype=dtype, device=device)
            hf = load_transformers(folder, dtype, device) if "transformers" in engines else None
            per_step_bytes[dtype] = weight_bytes(llm.model)
            prompts = make_prompts(llm.config.vocab_size, max(batch_sizes), prompt_len)
            for batch in batch_sizes:
                timings: dict[str, list[Timing]] = {}
                for r in range(repeats):
                    runs = {"matmul floor": lambda: matmul_floor(llm.model, batch, floor_steps),
                            "F.linear floor": lambda: matmul_floor(llm.model, batch, floor_steps, plain=True)}
                    if "minfer" in engines:
                        runs["minfer"] = lambda: time_minfer(llm, prompts, max_tokens, batch, warmup=r == 0)
                    if "transformers" in engines:
                        runs["transformers"] = lambda: time_transformers(hf[0], hf[1], prompts, max_tokens, batch,
                                                                         warmup=r == 0)
                    for name, run in runs.items():  # interleaved, so a busy moment hits all of them alike
                        bar.set_postfix_str(f"{dtype} batch {batch} {name} ({r + 1}/{repeats})")
                        timings.setdefault(name, []).append(run())
                        bar.update()
                best = {name: best_of(ts) for name, ts in timings.items()}
                if "minfer" in best and "transformers" in best:
                    a, b = best["minfer"].extra["token_ids"], best["transformers"].extra["token_ids"]
                    same = sum(x == y for x, y in zip(a, b)) / len(a)
                    best["minfer"].extra["same_tokens_as_transformers"] = same
                for t in best.values():
                    t.extra.pop("token_ids", None)
                    t.mbu = model_bandwidth_utilisation(per_step_bytes[dtype], t.tpot_s, bandwidth)
                    rows.append(t)
            del llm, hf
    bar.close()
    return {
        "benchmark": "generate",
        "model": random_weights and f"random weights, {random_weights} shapes" or model,
        "settings": {"dtypes": list(dtypes), "batch_sizes": list(batch_sizes), "max_tokens": max_tokens,
                     "prompt_len": prompt_len, "repeats": repeats, "floor_steps": floor_steps,
                     "engines": list(engines), "greedy": True, "ignore_eos": True},
        "machine": machine,
        "memory_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_per_step": per_step_bytes,
        "rows": [t.as_dict() for t in rows],
        "ratios": ratios(rows),
        "elapsed_s": time.perf_counter() - started,
    }


def best_of(timings: Sequence[Timing]) -> Timing:
    """The fastest of repeated measurements: lowest TPOT, and the lowest TTFT on its own."""
    best = min(timings, key=lambda t: t.tpot_s)
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    best.ttft_s = min(ttfts) if ttfts else None
    return best


def ratios(rows: Iterable[Timing]) -> list[dict]:
    """minfer / transformers and minfer / floor (decode tokens/s) for every dtype and batch size."""
    table: dict[tuple, dict[str, Timing]] = {}
    for t in rows:
        table.setdefault((t.dtype, t.batch_size), {})[t.engine] = t
    out = []
    for (dtype, batch), by in table.items():
        entry = {"dtype": dtype, "batch_size": batch}
        if "minfer" in by and "transformers" in by:
            entry["minfer_vs_transformers"] = by["minfer"].decode_tokens_per_s / by["transformers"].decode_tokens_per_s
        if "minfer" in by and "matmul floor" in by:
            entry["minfer_vs_floor"] = by["minfer"].decode_tokens_per_s / by["matmul floor"].decode_tokens_per_s
        if "minfer" in by and "same_tokens_as_transformers" in by["minfer"].extra:
            entry["same_tokens"] = by["minfer"].extra["same_tokens_as_transformers"]
        if "transformers" in by and "F.linear floor" in by:  # transformers multiplies with F.linear
            entry["transformers_vs_floor"] = (by["transformers"].decode_tokens_per_s
                                              / by["F.linear floor"].decode_tokens_per_s)
        out.append(entry)
    return out


def format_markdown(result: dict, command: Optional[str] = None) -> str:
    """The result as markdown: the machine, one table, the ratios against the targets."""
    m = result["machine"]
    s = result["settings"]
    capability = f" ({m['cpu_capability']})" if "cpu_capability" in m else ""  # absent from older results
    hw = m.get("gpu") or f"{m['cpu']}{capability}, {m['cores']} cores ({m['torch_threads']} torch threads)"
    if "load_average_1min" in m and not m.get("gpu"):
        hw += f", load average {m['load_average_1min']} at the start"
    lines = []
    busy = m.get("load_average_1min", 0) > max(0, m["cores"] - m["torch_threads"]) + 0.5
    if busy and not m.get("gpu"):
        lines.append(f"**Warning: the machine was busy (load average {m['load_average_1min']} on {m['cores']} cores): "
                     "timings are unreliable. Rerun on a quiet machine, or with `--threads` set to the free cores.**\n")
    if command:
        lines.append(f"Command: `{command}`  ")
    lines += [
        f"Machine: {hw}; torch {m['torch']}, transformers {m['transformers']}, device {m['device']}  ",
        f"Model: {result['model']}; prompts of {s['prompt_len']} tokens, {s['max_tokens']} greedy tokens per sequence "
        f"(EOS ignored), best of {s['repeats']}  ",
        f"Memory bandwidth (copy): {result['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; weights read per decode step: "
        + ", ".join(f"{d} {b / 1e6:.1f} MB" for d, b in result["weight_bytes_per_step"].items()),
        "",
        "| dtype | batch | engine | TTFT (ms) | TPOT (ms) | decode tok/s | MBU |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ttft = "–" if r["ttft_s"] is None else f"{r['ttft_s'] * 1e3:.1f}"
        lines.append(f"| {r['dtype']} | {r['batch_size']} | {r['engine']} | {ttft} | {r['tpot_s'] * 1e3:.1f} "
                     f"| {r['decode_tokens_per_s']:.1f} | {r['mbu'] * 100:.0f}% |")
    lines += ["", "| dtype | batch | minfer / transformers | minfer / floor | transformers / floor | same tokens |",
              "|---|---:|---:|---:|---:|---:|"]

    def cell(entry, key, target=None):
        if key not in entry:
            return "–"
        text = f"{entry[key]:.2f}"
        if target is not None:
            text += " ✓" if entry[key] >= target else " ✗"
        return text

    for e in result["ratios"]:
        floor_target = TARGET_FLOOR_FRACTION if e["batch_size"] == 1 else None
        lines.append(f"| {e['dtype']} | {e['batch_size']} | {cell(e, 'minfer_vs_transformers', TARGET_VS_TRANSFORMERS)} "
                     f"| {cell(e, 'minfer_vs_floor', floor_target)} | {cell(e, 'transformers_vs_floor')} "
                     f"| {'–' if 'same_tokens' not in e else format(e['same_tokens'], '.0%')} |")
    lines += ["", f"Targets: minfer ≥ {TARGET_VS_TRANSFORMERS}× transformers in the same dtype; at batch 1, minfer ≥ "
                  f"{TARGET_FLOOR_FRACTION:.2f}× the matmul floor. The matmul floor calls the "
                  "model's own linear layers (on CPU prepacked for oneDNN, as minfer runs them); the F.linear floor "
                  "calls F.linear on the same weights (as transformers runs them), and transformers / floor uses it. "
                  "MBU = weight bytes per step ÷ TPOT "
                  "÷ copy bandwidth. Same tokens: share of sequences where both engines generated identical ids."]
    return "\n".join(lines) + "\n"


def update_docs(markdown: str, path: Union[str, Path]) -> None:
    """Replace the generate-benchmark section of the docs page at `path` (between its markers), or add it."""
    intro = ("Decode speed of minfer against transformers' `generate` and against the bare matrix multiplications "
             "of a decode step (the matmul floor), same weights, same prompts, one process. How each number is "
             "timed: `minfer/lab/bench/generate.py` (the course notebooks use the same helpers). Regenerate with "
             "`python benchmarks/bench_generate.py --update-docs` on a quiet machine.")
    write_docs_section(markdown, path, DOCS_START, DOCS_END, "## minfer vs transformers `generate`", intro)


# --------------------------------------------------------------------------- command line

def add_bench_arguments(parser: argparse.ArgumentParser, docs_page: Union[str, Path, None] = None) -> None:
    """The benchmark's options. `--update-docs PATH` writes the table into the docs page at PATH; a
    script that knows where its docs page is passes it as `docs_page`, and `--update-docs` alone then
    means that page."""
    parser.add_argument("--quick", action="store_true", help="a short run (fewer tokens, one repeat) to check that it works")
    parser.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF directory")
    parser.add_argument("--random-weights", choices=sorted(MODEL_SHAPES), default=None,
                        help="benchmark random weights of these shapes instead of a model file")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--engines", nargs="+", default=["minfer", "transformers"])
    parser.add_argument("--max-tokens", type=int, help="tokens generated per sequence (quick 16, full 48)")
    parser.add_argument("--prompt-len", type=int, help="prompt length in tokens (quick 32, full 64)")
    parser.add_argument("--repeats", type=int, help="runs per measurement, best kept (quick 1, full 3)")
    parser.add_argument("--floor-steps", type=int, help="decode steps timed for the matmul floor")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", dest="json_path", help="write the results here as JSON")
    parser.add_argument("--markdown", dest="markdown_path", help="write the markdown table here")
    if docs_page is None:
        parser.add_argument("--update-docs", default=None, metavar="PATH",
                            help="replace the benchmark's marked section of the docs page at PATH with the table")
    else:
        parser.add_argument("--update-docs", nargs="?", const=str(docs_page), default=None, metavar="PATH",
                            help=f"replace the benchmark's marked section of {docs_page} (or PATH) with the table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def bench_from_args(args: argparse.Namespace, command: Optional[str] = None) -> dict:
    preset = dict(PRESETS["quick" if args.quick else "full"])
    for key in preset:
        if getattr(args, key, None) is not None:
            preset[key] = getattr(args, key)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_generate_benchmark(model=args.model, dtypes=args.dtypes, batch_sizes=args.batch_sizes,
                                    device=args.device, engines=args.engines, progress=not args.no_progress,
                                    random_weights=args.random_weights, **preset)
    command = command or "python -m minfer bench " + " ".join(sys.argv[2:])
    result["command"] = command
    markdown = format_markdown(result, command)
    print(markdown)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.markdown_path:
        Path(args.markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_path).write_text(markdown)
    if args.update_docs:
        update_docs(markdown, args.update_docs)
    return result
