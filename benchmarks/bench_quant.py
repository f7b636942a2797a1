"""Quantization in one run: perplexity, greedy agreement, bytes and decode speed per format.

    python benchmarks/bench_quant.py --quick                    # a smoke test (a few minutes)
    python benchmarks/bench_quant.py --json docs/bench_quant.json --update-docs   # the full run
    python benchmarks/bench_quant.py --configs none "gptq g64" --no-speed --merge docs/bench_quant.json --update-docs
                                                                # some rows again, into the full run's table

Configurations that do not fit the model (int4 g128 on SmolLM2-135M, whose hidden size 576 is
not a multiple of 128) are skipped with the reason.
llama.cpp is measured beside minfer when llama-cpp-python is installed (optional). The
measurements and the scrambled-model rows are explained in `minfer/lab/bench/quant.py`.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from minfer.lab.bench import quant as qb
from minfer.lab.bench.common import write_docs_section

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"  # this checkout's docs page
INTRO = ("Weight-only int8 (per output channel) and int4 (groups of 32/64/128, scale and zero point; 'awq': the same "
         "int4 after activation-aware scales and clipping computed at load time; 'gptq': the same int4 with GPTQ's "
         "codes, after AWQ's scales and in activation order, `minfer/quant/gptq.py`), and the int8 and fp8 (e4m3) KV caches, against "
         "the unquantized model on the fixed evaluation set of `minfer/lab/evaluate.py`, with bytes and decode speed, "
         "all in one process. How each number is made: `minfer/lab/bench/quant.py`.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run to check that everything works")
    parser.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF directory")
    parser.add_argument("--dtype", default="bfloat16", help="the same for every row (bfloat16: the realistic CPU baseline)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--configs", nargs="+", default=list(qb.CONFIGS), choices=list(qb.CONFIGS), metavar="CONFIG",
                        help=f"which rows ('none' is always needed): {list(qb.CONFIGS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for minfer (default 1)")
    parser.add_argument("--llama-cpp-threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--no-honest", action="store_true", help="skip the scrambled-model rows")
    parser.add_argument("--no-speed", action="store_true", help="quality and bytes only")
    for name in ("num_tokens", "window", "stride", "max_tokens", "batch_size", "repeats"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, help=f"override the preset's {name}")
    parser.add_argument("--json", dest="json_path", help="write the results here (full run: docs/bench_quant.json)")
    parser.add_argument("--update-docs", nargs="?", const=str(DOCS_PAGE), default=None, metavar="PATH",
                        help="replace the quantization section of docs/benchmarks.md (or PATH)")
    parser.add_argument("--render", metavar="JSON", help="only rebuild the table from a saved JSON")
    parser.add_argument("--docs-section", default="bench_quant", help="the marked section of the docs page to "
                        "replace")
    parser.add_argument("--plot", metavar="PNG", help="draw perplexity increase against weight bytes, every row a point")
    parser.add_argument("--merge", metavar="JSON", help="measure only --configs, put their rows into this saved "
                        "JSON's (same preset), and write the result there and to the docs")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_quant.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
    else:
        torch.set_num_threads(args.threads)
        overrides = {k: getattr(args, k) for k in ("num_tokens", "window", "stride", "max_tokens", "batch_size", "repeats")}
        result = qb.run_quant_benchmark(args.model, args.dtype, args.device, args.configs, args.quick,
                                        honest=not args.no_honest, speed=not args.no_speed,
                                        llama_cpp_threads=args.llama_cpp_threads, **overrides)
        result["command"] = command
        if args.merge:
            result = qb.merge_results(json.loads(Path(args.merge).read_text()), result)
            args.json_path = args.json_path or args.merge
    markdown = qb.format_markdown(result, result.get("command", command))
    print(markdown)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.plot:
        qb.plot_tradeoff(result).savefig(args.plot, dpi=110, bbox_inches="tight")
    if args.update_docs:
        write_docs_section(markdown, args.update_docs, f"<!-- {args.docs_section}:start -->",
                           f"<!-- {args.docs_section}:end -->",
                            heading="## Quantization: quality, bytes and speed", intro=INTRO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
