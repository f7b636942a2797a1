"""Soak benchmark: does memory stay flat over thousands of requests? (issue 15; minfer/lab/bench/soak.py)

    python benchmarks/bench_soak.py --run --update-docs          # the full run: the long soak, then the variants
    python benchmarks/bench_soak.py --main main.json --compare compare.json --update-docs   # re-render saved runs

The long soak is the default engine (step shapes in buckets) over --requests mixed requests.
The variants, each in a fresh process over --compare-requests, tell where memory goes: without
buckets, and with oneDNN's primitive cache switched off (ONEDNN_PRIMITIVE_CACHE_CAPACITY=0).
With --server, a soak through `python -m minfer serve` (openai clients, disconnects) is added.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from minfer.lab.bench.common import machine_info, write_docs_section
from minfer.lab.bench.soak import format_table, plot_variants

ROOT = Path(__file__).resolve().parent.parent
DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench_soak:start -->", "<!-- bench_soak:end -->"


def soak(out: Path, *args: str) -> dict:
    subprocess.run([sys.executable, "-m", "minfer", "bench", "soak", "--json", str(out), "--no-progress", *args],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return json.loads(out.read_text())


def render(main: dict, compare: dict, server: dict | None, commands: list[str]) -> str:
    p = main["plateau"]
    s = main["samples"]
    by_request = {row["requests"]: row["rss_mib"] for row in s}
    at = lambda r: by_request.get(r, float("nan"))  # noqa: E731
    m = main.get("machine") or machine_info()
    lines = [f"Commands: {'; '.join(f'`{c}`' for c in commands)} (one torch thread each). Machine: {m['cpu']}, "
             f"{m['cores']} cores, torch {m['torch']}; other work ran on the same cores during these runs (load average "
             "4–5), so compare the memory figures, and read the speeds as rough.", "",
             f"**The long soak** ({main['num_requests']} mixed requests through the engine, bfloat16, "
             f"{main['counts']['aborted']} aborted mid-way, {main['counts']['refused']} invalid ones refused, "
             f"{main['counts']['sampled_n']} with n > 1, {main['counts']['stop']} with stop strings): "
             f"RSS {s[1]['rss_mib']:.0f} MiB after the first samples, {at(2000):.0f} MiB at request 2,000, "
             f"{s[-1]['rss_mib']:.0f} MiB at the end; after the warm-up it grew "
             f"{p['slope_mib_per_1000']:.1f} MiB per 1,000 requests (target < 20) and changed "
             f"{100 * p['flat_change']:+.1f} % from request {p['flat_from_requests']} to the end (target within 5 %): "
             f"**{p['verdict']}**. Python heap {p['heap_growth_mib']:+.2f} MiB after the warm-up. Leaked KV blocks: "
             f"{main['leaked_blocks']} (largest gap between blocks in use and blocks held at any sample: "
             f"{main['max_block_discrepancy']}); requests left behind: {main['requests_left']}. "
             f"{main['output_tokens_per_s']:.0f} output tokens/s; bucket padding added "
             f"{100 * main['padding_fraction']:.1f} % rows to the tokens computed.", "",
             "**Where memory goes** (each variant in a fresh process, the same requests):", "",
             format_table(compare), "", "![soak](soak.png)", ""]
    if server:
        q = server["plateau"]
        lines += [f"**Through the server** ({server['num_requests']} requests from 24 concurrent openai clients; "
                  f"outcomes {server['outcomes']}): server RSS {server['samples'][1]['rss_mib']:.0f} → "
                  f"{server['samples'][-1]['rss_mib']:.0f} MiB, slope {q['slope_mib_per_1000']:.1f} MiB per 1,000 "
                  f"requests after the warm-up ({q['verdict']}); at the end {server['requests_left']:.0f} requests "
                  f"running or waiting and KV-cache use {server['kv_cache_usage_at_end']:.3f}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true", help="run the soaks (else render --main/--compare)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--compare-requests", type=int, default=1000)
    parser.add_argument("--server", action="store_true", help="also soak through the HTTP server")
    parser.add_argument("--server-requests", type=int, default=1000)
    parser.add_argument("--main", type=Path, default=ROOT / "docs" / "bench_soak_main.json")
    parser.add_argument("--compare", type=Path, default=ROOT / "docs" / "bench_soak_variants.json")
    parser.add_argument("--server-json", type=Path, default=ROOT / "docs" / "bench_soak_server.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "soak.png")
    parser.add_argument("--notes", type=Path, default=ROOT / "benchmarks" / "soak_notes.md",
                        help="the written analysis, appended to the section")
    parser.add_argument("--update-docs", action="store_true")
    args = parser.parse_args(argv)
    commands = [f"python -m minfer bench soak --requests {args.requests} --sample-every 250",
                f"python -m minfer bench soak --compare --requests {args.compare_requests} --sample-every 100"]
    if args.run:
        soak(args.main, "--requests", str(args.requests), "--sample-every", "250")
        soak(args.compare, "--compare", "--requests", str(args.compare_requests), "--sample-every", "100")
        if args.server:
            soak(args.server_json, "--server", "--requests", str(args.server_requests), "--sample-every", "100")
    if args.server or args.server_json.exists():
        commands.append(f"python -m minfer bench soak --server --requests {args.server_requests} --sample-every 100")
    main_run, compare = json.loads(args.main.read_text()), json.loads(args.compare.read_text())
    server = json.loads(args.server_json.read_text()) if args.server_json.exists() else None
    compare = {**compare, "variants": {"long soak (buckets)": main_run, **compare["variants"]}}
    plot_variants(compare, args.plot)
    markdown = render(main_run, compare, server, commands)
    if args.notes.exists():
        markdown += "\n" + args.notes.read_text()
    print(markdown)
    if args.update_docs:
        write_docs_section(markdown, DOCS_PAGE, START, END, "## Long-running stability (soak)",
                           "Memory over thousands of requests, the engine's block books, and step shapes in buckets "
                           "(`minfer/engine/buckets.py`).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
