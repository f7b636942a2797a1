"""Serving under load: minfer's server with continuous batching against its one-at-a-time server, over HTTP.

The same code runs as `python -m minfer bench serve`; it lives in `minfer/lab/bench/serve.py`, whose
docstring says how each number is measured. This script only knows where the docs page is.

    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 --sweep 0.5,1,2   # a server already running
    python benchmarks/bench_serve.py --launch --servers minfer --sweep 1,2 --num-prompts 16   # a short check

The measured run of docs/benchmarks.md (both servers started here, one after another; 12.5 minutes):

    OMP_NUM_THREADS=1 python benchmarks/bench_serve.py --launch --servers minfer,minfer-seq \\
        --sweep 0.125,0.25,0.375,0.5,0.75,1,1.5,2,3,4,6 --sweep-duration 24 --num-prompts 96 \\
        --goodput ttft:2000 --server-threads 1 --max-duration 120 --json docs/bench_serve.json --plot docs/bench_serve.png

To rebuild the docs from the saved run without measuring again:

    python benchmarks/bench_serve.py --render docs/bench_serve.json --plot docs/bench_serve.png \\
        --notes benchmarks/bench_serve_notes.md --update-docs
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from minfer.lab.bench.serve import add_serve_bench_arguments, run_serve_bench

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"  # this checkout's docs page


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_bench_arguments(parser, DOCS_PAGE)
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_serve.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        return run_serve_bench(args, command=command)
    except ValueError as exc:  # bad arguments found after parsing: a message, not a traceback
        print(f"bench_serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
