"""Where a decode step's time goes: torch.profiler around decode steps of the real model, grouped by op.

    python benchmarks/profile_decode.py                        # batch 1, bfloat16
    python benchmarks/profile_decode.py --seqs 32 --context 600 # 32 sequences with 600-token contexts
    python benchmarks/profile_decode.py --quantization int4

Prints the ops that take the most self CPU time per step, so a speed claim can be traced to the op that
pays for it (docs/benchmarks.md, "CPU speed").
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from minfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--seqs", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=max(args.seqs, 1))
    params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(1000 + 7 * i + j) % 40000 + 100 for j in range(args.context)]}
               for i in range(args.seqs)]
    for prompt in prompts:
        llm.add_request(prompt, params)
    for _ in range(3):  # prefill and the first decode steps (oneDNN compiles its kernels on first use)
        llm.engine.step()

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            llm.engine.step()
    while llm.has_unfinished_requests():
        llm.engine.step()

    events = prof.key_averages()
    total_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / args.steps
    print(f"{args.model} {args.dtype} quantization={args.quantization} seqs={args.seqs} context={args.context} "
          f"threads={args.threads}: {total_ms:.1f} ms per decode step (profiled)")
    print(f"{'op':<48} {'ms/step':>8} {'share':>6} {'calls/step':>10}")
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]:
        ms = e.self_cpu_time_total / 1e3 / args.steps
        print(f"{e.key[:48]:<48} {ms:8.2f} {ms / total_ms:6.0%} {e.count / args.steps:10.1f}")


if __name__ == "__main__":
    main()
