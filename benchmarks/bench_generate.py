"""minfer vs transformers `generate` vs the bare matmuls, on the same weights, in one run.

    python benchmarks/bench_generate.py --quick                  # a short check (about a minute)
    python benchmarks/bench_generate.py --json results.json --update-docs   # the full run (a few minutes)

The same code runs as `python -m minfer bench` (`minfer/lab/bench/generate.py`); the timing helpers live in
`minfer/lab/bench/decode_speed.py` and are the ones the course notebooks use. See `--help` for the options.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from minfer.lab.bench.generate import add_bench_arguments, bench_from_args

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"  # this checkout's docs page


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser, DOCS_PAGE)
    args = parser.parse_args(argv)
    bench_from_args(args, command="python benchmarks/bench_generate.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
