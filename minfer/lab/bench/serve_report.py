"""The load generator's report: a markdown table per run, the sustainable rates against the targets, the plot, JSON."""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
from pathlib import Path
from typing import Optional, Sequence, Union

from minfer.lab.bench.common import publish_report, write_docs_section
from minfer.lab.bench.latency import LATENCY_METRICS, MIN_SWEEP_PROMPTS

DOCS_START = "<!-- bench_serve:start -->"
DOCS_END = "<!-- bench_serve:end -->"
DOCS_HEADING = "## Serving under load: `python -m minfer bench serve`"
# Targets on CPU: sustainable rate under p99 TTFT <= 2 s, minfer against its one-at-a-time
# server, and against llama.cpp's server where that one is measured.
TARGETS = {"minfer_vs_one_at_a_time": 5.0, "minfer_vs_llama_cpp": 2.0}


def ratios(servers: Sequence[dict]) -> dict:
    """minfer's sustainable rate over the one-at-a-time server's and over llama.cpp's (where both were measured).

    If the other server sustained none of the swept rates, its sustainable rate lies below the lowest
    rate swept, so minfer's rate over that lowest rate is a lower bound on the ratio: stored with
    `<key>_is_lower_bound` True. No ratio (None) when minfer sustained none, or a rate was inf."""
    by = {s["name"]: s for s in servers}
    out = {}
    for other, key in (("minfer-seq", "minfer_vs_one_at_a_time"), ("llama-cpp", "minfer_vs_llama_cpp")):
        if "minfer" not in by or other not in by:
            continue
        mine, theirs = by["minfer"]["sustainable_rate"], by[other]["sustainable_rate"]
        lower_bound = theirs is None
        if lower_bound:
            theirs = min(run["request_rate"] for run in by[other]["runs"])
        finite = mine is not None and not math.isinf(mine) and not math.isinf(theirs)
        out[key] = mine / theirs if finite else None
        out[key + "_is_lower_bound"] = lower_bound and finite
    return out


def num_text(x: Optional[float], digits: int = 0) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def format_table(servers: Sequence[dict]) -> str:
    """Every run of every server as one markdown table row."""
    lines = ["| server | rate (req/s) | done | duration (s) | req/s | output tok/s | goodput (req/s) "
             "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | E2EL p50 / p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in servers:
        for r in s["runs"]:
            lines.append(
                f"| {s['name']} | {r['request_rate']:g} | {r['completed']}/{r['num_prompts']} | {r['duration']:.1f} "
                f"| {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {num_text(r['request_goodput'], 2)} | "
                + " | ".join(f"{num_text(r[f'median_{m}_ms'])} / {num_text(r[f'p99_{m}_ms'])}" for m in LATENCY_METRICS) + " |")
    return "\n".join(lines)


def format_markdown(result: dict) -> str:
    """The docs section: command, machine, workload, the table, sustainable rates and ratios against the targets."""
    m, s = result["machine"], result["settings"]
    slo = s["slo_ttft_ms"]
    if s["sweep_duration"]:
        per_rate = (f"per rate about rate × {s['sweep_duration']:g} s of requests (at least "
                    f"{min(MIN_SWEEP_PROMPTS, s['num_prompts'])}, at most {s['num_prompts']})")
    else:
        per_rate = f"{s['num_prompts']} requests per rate"
    arrivals = "Poisson" if s["burstiness"] == 1 else f"gamma, burstiness {s['burstiness']:g}"
    if s["max_concurrency"]:
        arrivals += f", at most {s['max_concurrency']} in flight"
    slo_text = ", ".join(f"{k} ≤ {v:g} ms" for k, v in s["goodput_slos_ms"].items())
    lines = [f"Command: `{result['command']}`  ",
             f"Machine: {m['cpu']}, {m['cores']} cores, load average {m.get('load_average_1min', '?')} at the start; "
             f"torch {m['torch']}, Python {m['python']}; {result['date']}, {result['elapsed_s'] / 60:.1f} min in all  ",
             f"Workload: {per_rate}, prompts of {s['input_len'][0]}–{s['input_len'][1]} tokens cut from "
             f"`pydoc_data.topics`, outputs of {s['output_len'][0]}–{s['output_len'][1]} tokens ({s['output_dist']}), "
             f"{'EOS ignored' if s['ignore_eos'] else 'stopping at EOS'}, temperature {s['temperature']:g}, "
             f"seed {s['seed']}; arrivals {arrivals}.  ",
             f"SLO: p99 TTFT ≤ {slo:g} ms; " + (f"goodput counts the requests meeting {slo_text}." if slo_text
                                                  else "no --goodput given, so no goodput.")]
    servers = result["servers"]
    if any(sv.get("command") for sv in servers):
        lines += ["", "Servers, one after another on this machine (OMP_NUM_THREADS="
                  f"{s['server_threads']}):", ""]
        lines += [f"- {sv['label']}: `{_short_command(sv['command'])}`" for sv in servers]
    lines += ["", format_table(servers), ""]
    lines.append(f"Sustainable request rate (the highest swept rate whose p99 TTFT ≤ {slo:g} ms with no request lost) "
                 "and the knee (the lowest swept rate whose goodput reaches 95% of the sweep's best):")
    lines.append("")
    for sv in servers:
        skipped = f"; not run (past the knee): {', '.join(f'{r:g}' for r in sv['rates_skipped'])}" if sv["rates_skipped"] else ""
        lines.append(f"- {sv['label']}: sustainable {_rate_text(sv['sustainable_rate'])}, knee "
                     f"{_rate_text(sv['knee_rate'])}, best goodput {num_text(sv['max_goodput'], 2)} req/s{skipped}")
    ra = ratios(servers)  # recomputed, so that --render of an older run states them as this code does
    names = {"minfer_vs_one_at_a_time": "minfer / one at a time", "minfer_vs_llama_cpp": "minfer / llama.cpp server"}
    for key, target in TARGETS.items():
        if key not in ra:
            continue
        value = ra[key]
        if value is None:
            verdict = "– (minfer sustained none of the swept rates, or a rate was inf)"
        elif ra[key + "_is_lower_bound"]:
            verdict = (f"≥ {value:.1f}× {'✓' if value >= target else '?'} (a lower bound: the other server sustained "
                       "none of the swept rates, so its rate is below the lowest one swept)")
        else:
            verdict = f"{value:.2f}× {'✓' if value >= target else '✗'}"
        lines.append(f"- {names[key]}, sustainable rate: {verdict} (target ≥ {target:g}×)")
    lines.append(f"- llama.cpp: {result['llama_cpp']}")
    return "\n".join(lines) + "\n"


def _rate_text(rate: Optional[float]) -> str:
    return "none of the swept rates" if rate is None else f"{rate:g} req/s"


def _short_command(command: str) -> str:
    """The server command without the interpreter's full path and the port (both change from run to run)."""
    parts = shlex.split(command)
    parts[0] = "python"
    out = []
    for prev, part in zip([""] + parts[:-1], parts):
        out.append("PORT" if prev == "--port" else part)
    return shlex.join(out)


def plot_sweep(result: dict, path: Union[str, Path]) -> None:
    """The latency-throughput curve: p50 and p99 TTFT and TPOT against achieved output throughput, one line per
    server, the TTFT SLO drawn across; and goodput against the offered request rate."""
    import matplotlib.ticker
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    fig = Figure(figsize=(17, 4.8))
    axes = fig.subplots(1, 3)
    slo = result["settings"]["slo_ttft_ms"]
    colors = {"minfer": "tab:green", "minfer-seq": "tab:gray", "llama-cpp": "tab:orange"}
    for i, server in enumerate(result["servers"]):
        runs = sorted(server["runs"], key=lambda r: r["request_rate"])
        color = colors.get(server["name"], f"C{i}")
        x = [r["output_throughput"] for r in runs]
        for ax, metric in ((axes[0], "ttft"), (axes[1], "tpot")):
            for q, style in (("median", "-o"), ("p99", "--^")):
                y = [r[f"{q}_{metric}_ms"] for r in runs]
                ax.plot(x, [float("nan") if v is None else v / 1000 for v in y], style, color=color,
                        label=f"{server['name']} {'p50' if q == 'median' else q}")
        for r, xi in zip(runs, x):  # which offered rate each point is
            if r["p99_ttft_ms"] is not None:
                axes[0].annotate(f"{r['request_rate']:g}", (xi, r["p99_ttft_ms"] / 1000), textcoords="offset points",
                                 xytext=(3, 4), fontsize=7, color=color)
        finite = [r for r in runs if not math.isinf(r["request_rate"])]
        axes[2].plot([r["request_rate"] for r in finite],
                     [r["request_goodput"] if r["request_goodput"] is not None else r["request_throughput"] for r in finite],
                     "-o", color=color, label=server["name"])
        if server.get("sustainable_rate") and not math.isinf(server["sustainable_rate"]):
            axes[2].axvline(server["sustainable_rate"], color=color, linestyle=":", alpha=0.7)
    axes[0].axhline(slo / 1000, color="tab:red", linestyle=":", label=f"SLO {slo / 1000:g} s")
    axes[0].set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 0.5, 2, 10 rather than 5x10^-1
    axes[0].yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axes[0].yaxis.set_major_formatter(plain)
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set_ylabel("TTFT (s, log scale)")
    axes[0].set_title("time to first token (numbers: offered req/s)")
    axes[1].set_ylabel("TPOT (s)")
    axes[1].set_title("time per output token")
    for ax in axes[:2]:
        ax.set_xlabel("achieved output throughput (tokens/s)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    rates = [r for r in result["settings"]["rates"] if not math.isinf(r)]
    if rates:
        axes[2].plot(rates, rates, color="black", linewidth=0.8, alpha=0.4, label="goodput = offered rate")
        if max(rates) / min(rates) > 8:  # rates doubling across the sweep: equal steps on a log axis
            axes[2].set_xscale("log", base=2)
            axes[2].set_yscale("log", base=2)
            axes[2].xaxis.set_major_formatter(plain)
            axes[2].yaxis.set_major_formatter(plain)
    axes[2].set_xlabel("offered request rate (req/s)")
    axes[2].set_ylabel("goodput (req/s meeting the SLO)")
    axes[2].set_title("goodput (dotted: sustainable rate)")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    fig.suptitle(f"{result['settings']['model']} {result['settings']['dtype'] or ''}, "
                 f"{result['machine']['cores']} CPU cores: latency against throughput")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=85)


INTRO = ("An OpenAI-compatible server measured over HTTP as users meet it: requests arrive at random (Poisson) "
         "times, stream their tokens, and what counts is TTFT and TPOT percentiles at a given load, and the load a "
         "server sustains within an SLO. The load generator works against any such server (minfer's, llama.cpp's, "
         "vLLM's) and writes vLLM's field names; `--launch` starts the servers itself, one after another on this "
         "machine. How it is measured: `minfer/lab/bench/serve.py`. Regenerate with `python benchmarks/bench_serve.py` "
         "(its docstring has the full command).")


def to_json(result: dict) -> str:
    """Indented JSON with each list of numbers on one line (the per-request lists would take a line per number)."""
    text = json.dumps(result, indent=1)
    return re.sub(r"\[([-0-9.eE,\snul]*)\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)


def report(result: dict, args: argparse.Namespace) -> int:
    """Print the table; write the JSON, the plot and the docs section where asked."""
    return publish_report(format_markdown(result), args, lambda: to_json(result),
                          lambda markdown: write_docs_section(markdown, args.update_docs, DOCS_START, DOCS_END,
                                                              DOCS_HEADING, INTRO),
                          lambda path: plot_sweep(result, path), "latency against throughput")
