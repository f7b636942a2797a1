"""The generate benchmark's report: minfer's speed against transformers and the matmul floor, as ratios and
as markdown against the targets, and its section of the docs page."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Union

from minfer.lab.bench.common import write_docs_section
from minfer.lab.bench.timing import Timing

DOCS_START = "<!-- bench_generate:start -->"
DOCS_END = "<!-- bench_generate:end -->"
# Targets: batch-1 decode at least 0.85x the speed of the matmul floor,
# and at least 1.3x the decode speed of transformers' generate in the same dtype.
TARGET_FLOOR_FRACTION = 0.85
TARGET_VS_TRANSFORMERS = 1.3


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
             "timed: `minfer/lab/bench/decode_speed.py` (the course notebooks use the same helpers). Regenerate with "
             "`python benchmarks/bench_generate.py --update-docs` on a quiet machine.")
    write_docs_section(markdown, path, DOCS_START, DOCS_END, "## minfer vs transformers `generate`", intro)

