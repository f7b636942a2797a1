"""The router on a labelled prompt set: share routed cheap, quality kept, cost, per threshold.

    OMP_NUM_THREADS=1 python benchmarks/bench_router.py --json docs/bench_router.json --update-docs

Full model: SmolLM2-135M in bfloat16. Cheap model: the same model quantized to int4 with
activation-aware scales (`quantization="awq"`). Each prompt of `minfer.router.routing_prompts`
(easy pattern completions and hard questions, made in code) is answered greedily by both; the
cheap answer "keeps quality" when its first tokens equal the full model's. The classifier is
the cheap model's lowest top-token probability over its answer; below the threshold the request
escalates. Cost by the seeds' formula, share_cheap x c + share_full x 1, with c the measured
decode-step time ratio, and also counting the cheap attempt every request pays (c + share_full).
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from minfer import LLM
from minfer.bench.common import write_docs_section
from minfer.bench.spec import cost_ratio
from minfer.router import evaluate_routing, greedy_answer, routing_prompts

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"  # this checkout's docs page

DOCS_START, DOCS_END = "<!-- bench_router:start -->", "<!-- bench_router:end -->"
THRESHOLDS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8]


def run(per_kind: int, max_tokens: int, cheap_quantization: str) -> dict:
    full = LLM("smollm2-135m", dtype="bfloat16", device="cpu")
    cheap = LLM("smollm2-135m", dtype="bfloat16", device="cpu", quantization=cheap_quantization)
    rows = []
    for kind, ids in routing_prompts(full.tokenizer, per_kind):
        a, b = greedy_answer(cheap.model, ids, max_tokens), greedy_answer(full.model, ids, max_tokens)
        rows.append({"kind": kind, "confidence": a.confidence, "agrees": a.token_ids == b.token_ids})
    c = cost_ratio(cheap.model, full.model)
    sweep = []
    for t in THRESHOLDS:
        r = evaluate_routing([x["confidence"] for x in rows], [x["agrees"] for x in rows], t, c)
        hard_cheap = sum(x["kind"] == "hard" and x["confidence"] >= t for x in rows)
        sweep.append({**r.__dict__, "hard_routed_cheap": hard_cheap})
    return {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "cheap": f"int4 ({cheap_quantization}), bfloat16 activations", "full": "bfloat16",
            "max_tokens": max_tokens, "num_prompts": len(rows), "cost_ratio": c,
            "cheap_agrees": sum(x["agrees"] for x in rows), "rows": rows, "sweep": sweep}


def markdown(result: dict, command: str) -> str:
    n = result["num_prompts"]
    lines = [f"Command: `{command}` ({result['threads']} torch thread). {n} prompts (half easy, half hard, made "
             f"in code); the cheap model ({result['cheap']}) gives the full model's first {result['max_tokens']} "
             f"tokens on {result['cheap_agrees']} of {n}. Measured cost ratio c = {result['cost_ratio']:.2f} "
             "(cheap / full decode step, batch 1).", "",
             "| threshold | routed cheap | hard ones routed cheap | quality kept | cost s·c + (1−s) | cost with the cheap attempt |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in result["sweep"]:
        lines.append(f"| {r['threshold']:.1f} | {r['share_cheap']:.0%} | {r['hard_routed_cheap']} | "
                     f"{r['quality_kept']:.0%} | {r['cost']:.2f} | {r['cost_with_classifier']:.2f} |")
    lines += ["", "Quality kept: the share of all requests whose served answer equals the full model's (an "
              "escalated request always does). A low threshold sends hard prompts to the cheap model and "
              "loses quality silently; a conservative one keeps quality but saves little, and once every "
              "request pays for the cheap attempt, routing only pays when c is small and the share "
              "routed cheap is large."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-kind", type=int, default=16, help="prompts per kind (easy, hard)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--cheap", default="awq", choices=["awq", "int4", "int8"], help="the cheap model's quantization")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--update-docs", nargs="?", const=str(DOCS_PAGE), default=None, metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run(args.per_kind, args.max_tokens, args.cheap)
    command = "python benchmarks/bench_router.py --json docs/bench_router.json --update-docs"
    text = markdown(result, command)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
    if args.update_docs:
        write_docs_section(text, args.update_docs, DOCS_START, DOCS_END,
                            heading="## Routing: easy requests to a cheap model")


if __name__ == "__main__":
    main()
