"""The `minfer` command line: `python -m minfer demo` and `python -m minfer bench`.

    python -m minfer demo [--prompt TEXT] [--max-tokens N]   chat one prompt, stream the answer, print TTFT/TPOT
    python -m minfer bench [--quick] [--json PATH] [--update-docs PATH] ...   minfer vs transformers vs the matmul floor
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def demo(args: argparse.Namespace) -> int:
    from minfer.bench.common import quiet
    from minfer.llm import LLM
    from minfer.sampling_params import SamplingParams

    with quiet():
        start = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, device=args.device)
        print(f"loaded {args.model} ({llm.dtype}, {llm.device}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        if getattr(llm.tokenizer, "chat_template", None):
            prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
        else:  # a base model (or the random test checkpoint) has no chat template: complete the text
            prompt = args.prompt
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        print(f"> {args.prompt}\n", flush=True)
        shown, last = "", None
        for last in llm.stream(prompt, params):
            text = last.outputs[0].text
            print(text[len(shown):], end="", flush=True)
            shown = text
    print()
    m = last.metrics
    line = f"\nTTFT {m.ttft * 1e3:.0f} ms ({m.num_prompt_tokens} prompt tokens)"
    if m.tpot:
        line += f" | TPOT {m.tpot * 1e3:.1f} ms | {1 / m.tpot:.1f} tokens/s ({m.num_output_tokens} tokens)"
    print(line)
    return 0


def bench(args: argparse.Namespace) -> int:
    from minfer.bench.generate import bench_from_args

    bench_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from minfer.bench.generate import add_bench_arguments

    parser = argparse.ArgumentParser(prog="minfer", description="minfer: a compact LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="chat one prompt with the default model, streaming, then print the timings")
    d.add_argument("--prompt", default=DEFAULT_PROMPT)
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--model", default="smollm2-135m", help="model name, .gguf file or HF directory")
    d.add_argument("--dtype", default="auto")
    d.add_argument("--device", default="auto")
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    d.add_argument("--seed", type=int, default=None)
    d.set_defaults(func=demo)
    b = sub.add_parser("bench", help="minfer vs transformers generate vs the matmul floor (decode tokens/s, TTFT, TPOT)")
    add_bench_arguments(b)
    b.set_defaults(func=bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad model names, dtypes, prompts: a message, not a traceback
        print(f"minfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
