"""Experts carved from SmolLM2-135M: quality against the active fraction, experts touched per batch, speed.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py --quick          # a smoke run (1024 tokens, fewer k)
    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py --json docs/bench_moe.json --plot docs/moe.png --update-docs \
        [--num-tokens 1024]       # the stored run used 1024 evaluation tokens (a loaded machine)

For E in {8, 16} the model's MLPs are carved once (`minfer.moe.carve`, on the calibration text),
then run with each top-k: perplexity on the fixed evaluation text and greedy agreement with the
dense model (`minfer.lab.evaluate`), against the active fraction k/E. k = E must give the dense model back.
Then for E = 16, k = 4: the distinct experts a decode step touches per layer at batch B, beside
E (1 - (1 - k/E)^B), and decode tokens/s at batch 1 and 32, dense against carved (CPU time of one
torch thread, alternating the two models). Float32 on the CPU.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from minfer import LLM
from minfer.lab.bench.common import machine_info, quiet, write_docs_section
from minfer.lab.bench.moe import decode_tokens_per_s, distinct_experts_per_step, expected_distinct_experts
from minfer.lab.evaluate import NUM_TOKENS, eval_set_info, greedy_agreement, greedy_reference, perplexity
from minfer.moe.carve import set_top_k

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DOCS_START, DOCS_END = "<!-- bench_moe:start -->", "<!-- bench_moe:end -->"
TOP_KS = {8: (1, 2, 4, 8), 16: (2, 4, 8, 16)}
QUICK_TOP_KS = {8: (2, 8), 16: (4, 16)}
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
SPEED_EXPERTS, SPEED_TOP_K = 16, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--num-tokens", type=int, default=NUM_TOKENS, help="evaluation tokens for perplexity")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--update-docs", action="store_true")
    parser.add_argument("--speed-only", action="store_true", help="re-measure only tokens/s, into the stored --json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.speed_only:
        result = json.loads(Path(args.json).read_text())
        with quiet():
            dense = LLM("smollm2-135m", device="cpu", enable_prefix_caching=False)
            llm = LLM("smollm2-135m", device="cpu", enable_prefix_caching=False, carve_experts=SPEED_EXPERTS,
                      carve_top_k=SPEED_TOP_K)
            result["speed"] = measure_speed(dense, llm)
        result["speed_machine"] = machine_info()
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        if args.update_docs:
            write_docs_section(markdown(result), DOCS_PAGE, DOCS_START, DOCS_END,
                               "## Mixture of experts: experts carved from SmolLM2-135M")
        return
    num_tokens = 1024 if args.quick else args.num_tokens
    top_ks = QUICK_TOP_KS if args.quick else TOP_KS
    start = time.perf_counter()
    with quiet():
        dense = LLM("smollm2-135m", device="cpu", enable_prefix_caching=False)
        reference = greedy_reference(dense)
        command = "OMP_NUM_THREADS=1 python benchmarks/bench_moe.py" + (" --quick" if args.quick else "") + (
            f" --num-tokens {args.num_tokens}" if args.num_tokens != NUM_TOKENS else "") + (
            " --json docs/bench_moe.json --plot docs/moe.png --update-docs")
        result = {"command": command,
                  "machine": machine_info(), "eval_set": eval_set_info(dense.tokenizer, num_tokens),
                  "dense": {"perplexity": perplexity(dense, num_tokens)}, "quality": [], "distinct": [], "speed": {}}
        print(f"dense: perplexity {result['dense']['perplexity']:.3f}")
        carved = {}
        for num_experts, ks in top_ks.items():
            t = time.perf_counter()
            llm = LLM("smollm2-135m", device="cpu", enable_prefix_caching=False, carve_experts=num_experts,
                      carve_top_k=ks[0])
            carve_seconds = time.perf_counter() - t
            for k in ks:
                set_top_k(llm.model, k)
                row = {"num_experts": num_experts, "top_k": k, "active_fraction": k / num_experts,
                       "perplexity": perplexity(llm, num_tokens), "greedy_agreement": greedy_agreement(llm, reference),
                       "carve_seconds": carve_seconds}
                result["quality"].append(row)
                print(f"E={num_experts} k={k}: perplexity {row['perplexity']:.3f}, agreement {row['greedy_agreement']:.3f}")
            carved[num_experts] = llm
        llm = carved[SPEED_EXPERTS]
        set_top_k(llm.model, SPEED_TOP_K)
        for b in BATCH_SIZES:
            row = distinct_experts_per_step(llm, b)
            row["formula"] = expected_distinct_experts(SPEED_EXPERTS, SPEED_TOP_K, b)
            result["distinct"].append(row)
            print(f"batch {b}: {row['distinct']:.2f} distinct experts per layer-step (formula {row['formula']:.2f})")
        result["speed"] = measure_speed(dense, llm)
    result["speed_config"] = {"num_experts": SPEED_EXPERTS, "top_k": SPEED_TOP_K}
    result["seconds"] = time.perf_counter() - start
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    if args.update_docs:
        write_docs_section(markdown(result), DOCS_PAGE, DOCS_START, DOCS_END, "## Mixture of experts: experts carved from SmolLM2-135M")


def measure_speed(dense, carved) -> dict:
    """Decode tokens/s at batch 1 and 32: dense, carved, dense again (the machine's load drifts)."""
    speed: dict = {}
    for b in (1, 32):
        for name, model in (("dense", dense), ("carved", carved), ("dense", dense)):
            speed.setdefault(str(b), {}).setdefault(name, []).append(decode_tokens_per_s(model, b))
        print(f"batch {b}: {speed[str(b)]}")
    return speed


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for num_experts in sorted({r["num_experts"] for r in result["quality"]}):
        rows = [r for r in result["quality"] if r["num_experts"] == num_experts]
        ax.plot([r["active_fraction"] for r in rows], [r["perplexity"] for r in rows], "o-", label=f"E = {num_experts}")
    ax.axhline(result["dense"]["perplexity"], color="gray", ls=":", label="dense")
    ax.set_yscale("log")
    ax.set_xlabel("active fraction k / E")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title("carved SmolLM2-135M: quality against sparsity")
    ax.legend()
    rows = result["distinct"]
    ax2.plot([r["batch_size"] for r in rows], [r["formula"] for r in rows], "--", label="formula E(1-(1-k/E)^B)")
    ax2.plot([r["batch_size"] for r in rows], [r["distinct"] for r in rows], "o", label="measured (carved, decode)")
    ax2.axhline(result["speed_config"]["num_experts"], color="gray", ls=":", label="all experts")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch size B")
    ax2.set_ylabel("distinct experts per layer and step")
    ax2.set_title(f"E = {result['speed_config']['num_experts']}, k = {result['speed_config']['top_k']}")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict) -> str:
    dense = result["dense"]["perplexity"]
    lines = [f"Command: `{result['command']}`; "
             f"{result['machine'].get('cpu', 'CPU')}, one torch thread, a 2-core machine shared with other jobs "
             f"(load average {result['machine'].get('load_average_1min', '?')}). "
             f"Perplexity on {result['eval_set']['num_tokens']} tokens of the evaluation text; greedy agreement "
             "with the dense model (`minfer.lab.evaluate`). Weight 1 on each chosen expert (k = E is the dense model).",
             "", "![carved experts](moe.png)", "",
             "| experts E | top-k | active k/E | perplexity | / dense | greedy agreement |", "|---:|---:|---:|---:|---:|---:|",
             f"| dense | | 1.00 | {dense:.3f} | | 1.000 |"]
    for r in result["quality"]:
        lines.append(f"| {r['num_experts']} | {r['top_k']} | {r['active_fraction']:.2f} | {r['perplexity']:.3f} | "
                     f"{r['perplexity'] / dense:.3g}x | {r['greedy_agreement']:.3f} |")
    cfg = result["speed_config"]
    lines += ["", f"Distinct experts a decode step touches per layer (E = {cfg['num_experts']}, k = {cfg['top_k']}):", "",
              "| batch B | measured | formula E(1-(1-k/E)^B) | busiest expert's share of the batch |", "|---:|---:|---:|---:|"]
    for r in result["distinct"]:
        lines.append(f"| {r['batch_size']} | {r['distinct']:.2f} | {r['formula']:.2f} | {r['busiest_share']:.2f} |")
    lines += ["", "Decode tokens/s (CPU time of one thread; dense measured before and after the carved model, the best kept):", "",
              f"| batch | dense | carved E = {cfg['num_experts']}, k = {cfg['top_k']} | carved / dense |", "|---:|---:|---:|---:|"]
    for b, speeds in result["speed"].items():
        d, c = max(speeds["dense"]), max(speeds["carved"])
        lines.append(f"| {b} | {d:.1f} | {c:.1f} | {c / d:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
