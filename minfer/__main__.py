"""The `minfer` command line (also installed as the `minfer` script).

    python -m minfer demo [--prompt TEXT] [--max-tokens N]   chat one prompt, stream the answer, print TTFT/TPOT
    python -m minfer serve [MODEL] [--port 8000] [engine args]   an OpenAI-compatible server (minfer/serving)
    python -m minfer quantize MODEL --method gptq|awq|int8|int4|nf4|fp8|gptq_fp8 --out DIR   a quantized checkpoint, loaded by LLM(DIR)
    python -m minfer bench [--quick] [--json PATH] [--update-docs PATH] ...   minfer vs transformers vs the matmul floor
    python -m minfer bench serve [--base-url URL] [--request-rate R] ...   load-test an OpenAI-compatible server
    python -m minfer bench soak [--requests N] [--compare]   mixed requests for a long time: does memory stay flat?
    python -m minfer bench host [--batches 1 32 256]   the host's work per decode step: µs per sequence, ATen ops
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def demo(args: argparse.Namespace) -> int:
    from minfer.lab.bench.common import quiet
    from minfer.llm import LLM
    from minfer.sampling_params import SamplingParams

    with quiet():
        start = time.perf_counter()
        llm = LLM(args.model, dtype=args.dtype, device=args.device)
        print(f"loaded {args.model} ({llm.dtype}, {llm.device}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        if getattr(llm.tokenizer, "chat_template", None):
            prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}])
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
    from minfer.lab.bench.generate import bench_from_args

    bench_from_args(args)
    return 0


def serve(args: argparse.Namespace) -> int:
    from minfer.serving.api_server import serve as run_server

    return run_server(args)


def quantize(args: argparse.Namespace) -> int:
    from minfer.quant.checkpoint import run_quantize

    return run_quantize(args)


def bench_soak(args: argparse.Namespace) -> int:
    from minfer.lab.bench.soak import run_soak

    return run_soak(args)


def bench_serve(args: argparse.Namespace) -> int:
    from minfer.lab.bench.serve import run_serve_bench

    return run_serve_bench(args)


def bench_host(args: argparse.Namespace) -> int:
    from minfer.lab.bench.host import run_from_args

    run_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from minfer.lab.bench.generate import add_bench_arguments
    from minfer.lab.bench.host import add_host_arguments
    from minfer.lab.bench.serve import add_serve_bench_arguments
    from minfer.lab.bench.soak import add_soak_arguments
    from minfer.quant.checkpoint import add_quantize_arguments
    from minfer.serving.api_server import add_serve_arguments

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
    s = sub.add_parser("serve", help="serve a model over OpenAI's HTTP API (completions, chat, streaming, /metrics)")
    add_serve_arguments(s)
    s.set_defaults(func=serve)
    q = sub.add_parser("quantize", help="quantize a model once and save it (safetensors + config.json): LLM(DIR) loads it")
    add_quantize_arguments(q)
    q.set_defaults(func=quantize)
    b = sub.add_parser("bench", help="minfer vs transformers generate vs the matmul floor (decode tokens/s, TTFT, TPOT); "
                                     "'bench serve': load-test a server")
    add_bench_arguments(b)
    b.set_defaults(func=bench)
    bench_sub = b.add_subparsers(dest="bench_command", required=False)
    bs = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server: latency percentiles, goodput, rate sweeps")
    add_serve_bench_arguments(bs)
    bs.set_defaults(func=bench_serve)
    bk = bench_sub.add_parser("soak", help="thousands of mixed requests through the engine: memory, leaked blocks, plateau")
    add_soak_arguments(bk)
    bk.set_defaults(func=bench_soak)
    bh = bench_sub.add_parser("host", help="the host's work per decode step on a tiny model: µs per sequence and ATen "
                                           "operations at 1, 32 and 256 sequences")
    add_host_arguments(bh)
    bh.set_defaults(func=bench_host)
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
