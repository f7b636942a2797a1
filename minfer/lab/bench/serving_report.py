"""The serving benchmark's report: markdown tables against the targets, the docs section, and the plot."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from minfer.lab.bench.common import write_docs_section

DOCS_START = "<!-- bench_serving:start -->"
DOCS_END = "<!-- bench_serving:end -->"
# Targets on CPU: continuous batching against one by one and against transformers, and what prefix caching saves
# (prefill tokens) and buys (TTFT).
TARGETS = {"continuous_vs_sequential": 6.0, "continuous_vs_transformers": 3.0,
           "prefill_tokens_saved": 0.90, "ttft_speedup": 5.0}


def _ms(x: float) -> str:
    return "–" if x is None or x != x else f"{x * 1e3:.0f}"


def _mib(x: Optional[float]) -> str:
    return "–" if x is None else f"{x / 2**20:.1f}"


def _check(value: float, target: float) -> str:
    return f"{value:.2f}× {'✓' if value >= target else '✗'} (target ≥ {target:g}×)"


def format_markdown(result: dict, command: Optional[str] = None) -> str:
    """The result as markdown: the machine and workload, the engines' table, the ratios, KV waste, prefix caching."""
    m, s = result["machine"], result["settings"]
    lines = []
    busy = m.get("load_average_1min", 0) > max(0, m["cores"] - m["torch_threads"]) + 0.5
    if busy:
        lines.append(f"**Warning: the machine was busy (load average {m['load_average_1min']} on {m['cores']} cores): "
                     "timings are noisy; the ratios below were measured side by side in one run.**\n")
    if command:
        lines.append(f"Command: `{command}`  ")
    lines += [
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), load average "
        f"{m.get('load_average_1min', '?')} at the start; torch {m['torch']}, transformers {m['transformers']}  ",
        f"Model: {result['model']} in {result['dtype']}; greedy, EOS ignored; block size {s['block_size']}, "
        f"max_num_seqs {s['max_num_seqs']}, max_num_batched_tokens {s['max_num_batched_tokens']}  ",
        f"Workload: {s['num_requests']} requests, prompts of {s['prompt_len'][0]}–{s['prompt_len'][1]} tokens cut from "
        f"`pydoc_data.topics` (the Python docs shipped with CPython), outputs of {s['output_len'][0]}–{s['output_len'][1]} "
        f"tokens (log-uniform: many short, a long tail; seed {s['seed']}): {s['workload_prompt_tokens']} prompt and {s['workload_output_tokens']} "
        f"output tokens. **Subset** rows ran only the first {s['subset']} requests (one by one and transformers are too "
        "slow for all of them here): compare their *rates*, not their totals.",
        "",
        "| engine | requests | output tok/s | req/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) "
        "| KV used / reserved (MiB) | prefix hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        t, p = r["ttft"], r["tpot"]
        kv = f"{_mib(r.get('kv_used_bytes'))} / {_mib(r.get('kv_reserved_bytes'))}" if "kv_used_bytes" in r else "–"
        hit = f"{r['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in r else "–"
        name = r["engine"] + (" *(subset)*" if r.get("subset") and "subset" not in r["engine"] else "")
        lines.append(f"| {name} | {r['requests']} | {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.3f} "
                     f"| {_ms(t['mean'])} / {_ms(t['p50'])} / {_ms(t['p99'])} | {_ms(p['mean'])} / {_ms(p['p50'])} / "
                     f"{_ms(p['p99'])} | {kv} | {hit} |")
    loads = [f"{r['engine']} {r['load_1min_after']}" for r in result["rows"] if r.get("load_1min_after") is not None]
    if loads:
        lines += ["", "Load average (1 min) at the end of each run, on " + f"{m['cores']} cores: " + "; ".join(loads) + "."]
    ra = result["ratios"]
    lines += ["", "Ratios of output tokens/s:", "",
              f"- continuous (all requests) / one by one (subset): {_check(ra['continuous_vs_sequential'], TARGETS['continuous_vs_sequential'])}; "
              f"on the same subset: {ra['subset_continuous_vs_sequential']:.2f}×"]
    if "continuous_vs_transformers" in ra:
        lines.append(f"- continuous (all requests) / transformers padded batches (subset): "
                     f"{_check(ra['continuous_vs_transformers'], TARGETS['continuous_vs_transformers'])}; "
                     f"on the same subset: {ra['subset_continuous_vs_transformers']:.2f}×")
    lines.append(f"- continuous / static batching (all requests, same max_num_seqs): {ra['continuous_vs_static']:.2f}×")
    lines.append(f"- llama.cpp: {result['llama_cpp']}")
    lines += ["", f"KV memory on the same workload ({result['kv_bytes_per_token']} bytes per token; each request "
                  "counted at its largest, summed over requests):", "",
              "| layout | reserved (MiB) | used (MiB) | waste |", "|---|---:|---:|---:|"]
    for w in result["kv_waste"]:
        lines.append(f"| {w['scheme']} | {_mib(w['reserved_bytes'])} | {_mib(w['used_bytes'])} | {w['waste']:.1%} |")
    pr = result.get("prefix")
    if pr:
        ps = pr["settings"]
        lines += ["", f"Prefix caching: {ps['requests']} requests at once, a shared {ps['system_tokens']}-token text "
                      f"(from the same docs) + a short question each, {ps['max_tokens']} output tokens; passages: "
                      f"{ps['num_passages']} × {ps['passage_tokens']} tokens, then the question.", "",
                  "| case | prompt tokens | prefill tokens computed | hit rate | TTFT p50 (ms) | TTFT p99 (ms) |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in pr["rows"]:
            lines.append(f"| {r['case']} | {r['prompt_tokens']} | {r['prefill_tokens_computed']} | {r['hit_rate']:.1%} "
                         f"| {_ms(r['ttft']['p50'])} | {_ms(r['ttft']['p99'])} |")
        sm = pr["summary"]
        if "cold" in pr:  # stored results without it still format
            lines += ["", f"Every case above ran on a warmed engine; the process's first request, cold and alone, "
                          f"took {_ms(pr['cold']['ttft']['p50'])} ms to its first token."]
        lines += ["", f"- prefill tokens saved by the cache (shared text first): {sm['prefill_tokens_saved']:.1%} "
                      f"{'✓' if sm['prefill_tokens_saved'] >= TARGETS['prefill_tokens_saved'] else '✗'} "
                      f"(target ≥ {TARGETS['prefill_tokens_saved']:.0%})",
                  f"- median TTFT without / with the cache: {_check(sm['ttft_speedup'], TARGETS['ttft_speedup'])}"]
    return "\n".join(lines) + "\n"


def update_docs_section(markdown: str, path: Union[str, Path], start: str = DOCS_START,
                        end: str = DOCS_END, heading: str = "## Serving: continuous batching, paged KV, prefix caching",
                        intro: str = "") -> None:
    """Replace the serving section of the docs page at `path` (between its markers), or append it."""
    write_docs_section(markdown, path, start, end, heading, intro)


def plot(result: dict, path: Union[str, Path]) -> None:
    """Output tokens/s per engine, the TTFT distribution per engine, and median TTFT of the prefix cases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    panels = 3 if result.get("prefix") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    names = [r["engine"].replace(" (padded batches)", "\n(padded)").replace(" (subset)", "\n(subset)")
             + ("\n(subset)" if r.get("subset") and "subset" not in r["engine"] else "") for r in rows]
    colors = ["tab:green" if "continuous" in r["engine"] else "tab:gray" for r in rows]
    axes[0].barh(names, [r["output_tokens_per_s"] for r in rows], color=colors)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("output tokens / s (higher is better)")
    axes[0].set_title(f"{result['model']} {result['dtype']}, CPU")
    axes[1].boxplot([[t for t in r["ttfts"] if t is not None] for r in rows], vert=False, tick_labels=names)
    axes[1].invert_yaxis()
    axes[1].set_xscale("log")
    axes[1].set_xlabel("TTFT (s, log scale)")
    axes[1].set_title("time to first token")
    if panels == 3:
        pr = result["prefix"]["rows"]
        axes[2].barh([r["case"].replace(", ", "\n", 1) for r in pr], [r["ttft"]["p50"] for r in pr],
                     color=["tab:green" if r["hit_rate"] > 0.5 else "tab:red" for r in pr])
        axes[2].invert_yaxis()
        for i, r in enumerate(pr):
            axes[2].text(r["ttft"]["p50"], i, f" hit {r['hit_rate']:.0%}", va="center")
        axes[2].set_xlabel("median TTFT (s)")
        axes[2].set_title("prefix caching")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
