"""Serving benchmark: minfer continuous batching vs static batching vs one by one vs transformers, in one run.

    python benchmarks/bench_serving.py --quick                     # a tiny run (under a minute)
    python benchmarks/bench_serving.py --json serving.json --update-docs --plot docs/serving.png   # the full run

Also measures KV memory waste (contiguous vs paged) and prefix caching (shared system prompt with
and without the cache, the shared part placed last, passages in a stable vs shuffled order).
The logic lives in `minfer/lab/bench/serving.py` and the `serving_*.py` modules beside it (the course
notebooks call them too). `benchmarks/serving_notes.md` holds the written analysis (what falls short and
why); to rebuild the docs from a saved run without rerunning:

    python benchmarks/bench_serving.py --render serving.json --notes benchmarks/serving_notes.md --update-docs --plot docs/serving.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from minfer.lab.bench.common import publish_report
from minfer.lab.bench.serving import run_serving_benchmark
from minfer.lab.bench.serving_report import format_markdown, plot, update_docs_section

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"  # this checkout's docs page


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 short requests, small prefix experiment")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default: clearly faster on this CPU) or float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: steadier on a shared machine; 0 = torch's choice)")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--subset", type=int, help="requests run one by one and by transformers (the first N)")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="KV pool size (default: the engine's, 1 GiB on CPU)")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-prefix", action="store_true", help="skip the prefix-caching experiment")
    parser.add_argument("--json", dest="json_path", help="write the results here as JSON")
    parser.add_argument("--plot", help="write a PNG plot here (e.g. docs/serving.png)")
    parser.add_argument("--update-docs", nargs="?", const=str(DOCS_PAGE), default=None, metavar="PATH",
                        help="replace the bench_serving section of docs/benchmarks.md (or PATH)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--render", metavar="JSON", help="no run: rebuild the tables, plot and docs from a saved --json")
    parser.add_argument("--notes", metavar="FILE", help="markdown appended to the docs section (what limits the numbers)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        return report(result, result["command"], args)
    result = run_serving_benchmark(model=args.model, dtype=args.dtype, quick=args.quick,
                                   transformers=not args.no_transformers, prefix=not args.no_prefix,
                                   progress=not args.no_progress, seed=args.seed, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                   num_requests=args.num_requests,
                                   subset=args.subset, max_num_seqs=args.max_num_seqs)
    command = "python benchmarks/bench_serving.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result["command"] = command
    return report(result, command, args)


def report(result: dict, command: str, args: argparse.Namespace) -> int:
    return publish_report(format_markdown(result, command), args, lambda: json.dumps(result, indent=2),
                          lambda markdown: update_docs_section(markdown, args.update_docs, intro=INTRO),
                          lambda path: plot(result, path), "serving benchmark")


INTRO = ("Many requests at once, as a server sees them: minfer's continuous batching against its static batches, "
         "one request at a time, and transformers' `generate` on padded batches; the KV memory a contiguous cache "
         "reserves against paged blocks; and prefix caching. Everything in one process, side by side. How it is "
         "measured: `minfer/lab/bench/serving.py`. Regenerate with `python benchmarks/bench_serving.py --update-docs "
         "--plot docs/serving.png`.")

if __name__ == "__main__":
    sys.exit(main())
