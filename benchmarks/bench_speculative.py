"""Speculative decoding at batch 1: measured speedup beside the formula's, for n-gram lookup and drafts.

    OMP_NUM_THREADS=1 python benchmarks/bench_speculative.py --quick     # a smoke run (a few minutes)
    OMP_NUM_THREADS=1 python benchmarks/bench_speculative.py --json docs/bench_speculative.json \
        --plot docs/speculative.png --update-docs      # the full run (20 minutes on a busy 2-core machine)

Two tasks: input-grounded (repeat / fix typos in / rewrite a pydoc passage: the answer copies its
input) and open chat. Proposers: none (the baseline), n-gram lookup ("[ngram]"), the distilled
draft ("smollm2-135m-draft"), the same-shape undistilled draft and the EAGLE head ("smollm2-135m-eagle": one
layer reading the target's features, minfer/speculative/eagle.py), each for k in {1, 2, 4, 6}
draft tokens. For each: decode tokens/s; vLLM's metrics under vLLM's names (draft_acceptance_rate
= accepted / proposed draft tokens, mean_acceptance_length = tokens per verification pass); the
per-token alpha of the formula (acceptance given the earlier drafts accepted, maximum-likelihood:
accepted / (accepted + rejections), see minfer/speculative/stats.py); the draft cost ratio c (one draft
decode step / one target decode step) and the verify cost v (a target pass over k+1 positions /
a pass over one), both measured here; and the speedup the formula predicts,
(1 - alpha^(k+1)) / ((1 - alpha)(v + k c)), with v = 1 (Leviathan et al., 2023) and with the
measured v, beside the measured one. Greedy, one thread.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minfer import LLM
from minfer.lab.bench.common import machine_info, quiet, synchronize, write_docs_section
from minfer.lab.bench.spec import (CLOCKS, chat_prompts, cost_ratio, decode_rate, expected_speedup, forward_cost,
                               grounded_prompts, verify_costs)
from minfer.kv_cache import KVCache
from minfer.speculative import make_proposer

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"  # this checkout's docs page

DOCS_START, DOCS_END = "<!-- bench_speculative:start -->", "<!-- bench_speculative:end -->"
PROPOSERS = ("[ngram]", "smollm2-135m-draft", "smollm2-135m-draft-undistilled", "smollm2-135m-eagle")
TARGETS = {("chat", "smollm2-135m-draft"): 1.5, ("grounded", "[ngram]"): 2.0,  # minimum best speedup, CPU batch 1
           ("chat", "smollm2-135m-eagle"): 1.5}


@torch.inference_mode()
def eagle_cost_ratio(head, target, context_len: int = 256, repeats: int = 10, clock: str = "wall") -> float:
    """c for an EAGLE head: one chained guess (a row through the head after context_len rows, and its
    top-K logits) / one target decode step, at batch 1."""
    now, device = CLOCKS[clock], head.fc.weight.device
    cache = KVCache(head.config, 1, context_len + 1, head.fc.weight.dtype, device)
    hidden = head.config.hidden_size
    head(torch.randn(1, context_len, hidden, device=device), torch.zeros(1, context_len, dtype=torch.long, device=device),
         torch.arange(context_len, device=device)[None], cache)
    feature, token = torch.randn(1, 1, hidden, device=device), torch.zeros(1, 1, dtype=torch.long, device=device)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        cache.length, position = context_len, torch.tensor([[context_len]], device=device)
        start = now()
        head.logits(head(feature, token, position, cache)).argmax()
        synchronize(device)
        times.append(now() - start)
    return statistics.median(times[1:]) / forward_cost(target, context_len, 1, repeats, clock)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    with quiet():
        llm = LLM(args.model, dtype=args.dtype, device=args.device, enable_prefix_caching=False)
    clock = args.clock or ("cpu" if args.device == "cpu" else "wall")
    ks = args.ks or ([2, 4] if args.quick else [1, 2, 4, 6])
    n, max_tokens = (1, 24) if args.quick else (args.num_prompts, args.max_tokens)
    tasks = {"grounded": grounded_prompts(llm, n), "chat": chat_prompts(llm, n)}
    result = {"machine": machine_info(args.device), "model": args.model, "dtype": args.dtype, "ks": ks,
              "num_prompts": n, "max_tokens": max_tokens, "clock": clock, "rows": [], "skipped": {}, "cost_ratio": {}}
    # v: how much more a pass over k+1 positions costs than a pass over one (the formula assumes: nothing)
    result["verify_cost"] = verify_costs(llm.model, ks, repeats=20, clock=clock)
    one = forward_cost(llm.model, 256, 1, clock=clock)  # a target step, to express lookup time in steps
    proposers = {}
    for name in args.proposers:
        try:
            proposers[name] = make_proposer(name, llm.model, llm.tokenizer, llm.max_model_len, llm.dtype, llm.device)
        except (ValueError, ImportError, FileNotFoundError) as exc:
            result["skipped"][name] = str(exc)
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        model, head = getattr(proposers[name], "model", None), getattr(proposers[name], "head", None)
        result["cost_ratio"][name] = (cost_ratio(model, llm.model, clock=clock) if model is not None else
                                      eagle_cost_ratio(head, llm.model, clock=clock) if head is not None else 0.0)
    for task, prompts in tasks.items():
        plain_rates, none_row = [], {"task": task, "proposer": "none", "k": 0, "speedup": 1.0}
        result["rows"].append(none_row)
        for name, proposer in proposers.items():
            for k in ks:
                # plain decoding timed right before each configuration: on a shared machine the load
                # drifts, and a speedup is only as good as the pair it divides
                base = decode_rate(llm, prompts, max_tokens, clock=clock)
                r = decode_rate(llm, prompts, max_tokens, proposer, k, clock=clock)
                plain_rates.append(base["tokens_per_s"])
                spec, c, v = r["spec"], result["cost_ratio"][name], result["verify_cost"][k]
                if name == "[ngram]":  # lookup costs no model step; count its measured time anyway
                    c = spec["draft_time_s"] / max(1, spec["num_draft_tokens"]) / one
                alpha = spec["alpha"]
                row = {"task": task, "proposer": name, "k": k, "tokens_per_s": r["tokens_per_s"],
                       "plain_tokens_per_s": base["tokens_per_s"], "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                       "draft_acceptance_rate": spec["draft_acceptance_rate"],
                       "mean_acceptance_length": spec["mean_acceptance_length"],
                       "acceptance_rate_per_position": spec["acceptance_rate_per_position"], "alpha": alpha,
                       "c": c, "verify_cost": v, "predicted": expected_speedup(alpha, k, c),
                       "predicted_with_verify_cost": expected_speedup(alpha, k, c, v),
                       "same_tokens_as_plain": r["token_ids"] == base["token_ids"]}
                result["rows"].append(row)
                print(f"{task:9s} {name:18.18s} k={k} {row['tokens_per_s']:7.1f} tok/s (plain {base['tokens_per_s']:.1f}) "
                      f"x{row['speedup']:.2f} "
                      f"(predicted x{row['predicted']:.2f}, with v x{row['predicted_with_verify_cost']:.2f}; "
                      f"alpha {alpha:.2f}, c {c:.3f}, v {v:.2f})", file=sys.stderr)
        none_row["tokens_per_s"] = (statistics.median(plain_rates) if plain_rates
                                    else decode_rate(llm, prompts, max_tokens, clock=clock)["tokens_per_s"])
    result["targets"] = []
    for (task, name), goal in ((key, goal) for key, goal in TARGETS.items() if key[1] in args.proposers):
        rows = [r for r in result["rows"] if r["task"] == task and r["proposer"] == name]
        best = max(rows, key=lambda r: r["speedup"], default=None)
        result["targets"].append({"task": task, "proposer": name, "goal": goal, "best": best and best["speedup"],
                                  "best_row": best,
                                  "status": "skipped" if best is None else ("met" if best["speedup"] >= goal else "missed")})
    return result


def format_markdown(result: dict, command: str) -> str:
    m = result["machine"]
    lines = [f"`{command}`", "",
             f"{result['model']} ({result['dtype']}), batch 1, greedy, {result['num_prompts']} prompts per task, "
             f"up to {result['max_tokens']} tokens each; {m['cpu']}, {m['torch_threads']} torch thread(s), load "
             f"average {m.get('load_average_1min', '?')} at the start. Draft cost ratio c (draft decode step / target "
             "decode step): " + ", ".join(f"{k} {v:.3f}" for k, v in result["cost_ratio"].items()) + ". Verify cost v (a "
             "target pass over k+1 positions / a pass over one): " +
             ", ".join(f"{v:.2f} (k={k})" for k, v in result["verify_cost"].items()) + "; the formula assumes 1.", "",
             "| task | proposer | k | tokens/s | plain tokens/s | speedup | draft_acceptance_rate | "
             "mean_acceptance_length | alpha | predicted (v = 1) | predicted (measured v) | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["proposer"] == "none":
            lines.append(f"| {r['task']} | none | - | {r['tokens_per_s']:.1f} (median) | - | 1.00x | - | - | - | - | - | - |")
        else:
            lines.append(f"| {r['task']} | {r['proposer']} | {r['k']} | {r['tokens_per_s']:.1f} | "
                         f"{r['plain_tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                         f"{r['draft_acceptance_rate']:.2f} | {r['mean_acceptance_length']:.2f} | {r['alpha']:.2f} | "
                         f"{r['predicted']:.2f}x | {r['predicted_with_verify_cost']:.2f}x | "
                         f"{'yes' if r['same_tokens_as_plain'] else 'no'} |")
    lines += ["", "Each speedup divides by plain decoding timed on the same prompts just before (plain tokens/s): "
              "the machine is shared and its load drifts. " + CLOCK_NOTE[result["clock"]] + " "
              "draft_acceptance_rate and mean_acceptance_length are vLLM's metrics. alpha is the formula's: the "
              "chance that a draft token is accepted given that the ones before it were, estimated by maximum "
              "likelihood as accepted / (accepted + rejections) (minfer/speculative/stats.py). draft_acceptance_rate is "
              "smaller and falls with k, because a late draft token only counts once every earlier one was accepted. "
              "The predictions use the measured alpha and c; the second also charges the verification pass its "
              "measured cost v instead of one step. What the formula still leaves out: n-gram lookup finds no "
              "draft at some steps (those are plain steps), the engine's own work per pass, and acceptance that "
              "is not independent from one position to the next (a copied run tends to continue).", "",
              "Same tokens: whether the greedy output equals plain decoding's. In bfloat16 a pass over several "
              "positions rounds slightly differently from one-position steps, so a near-tie can flip a token (the "
              "output is still the target's greedy choice under those numerics); tests/test_speculative.py checks "
              "exact equality in float32.", "", "Targets (best k):"]
    for t in result["targets"]:
        r = t["best_row"]
        best = "n/a" if r is None else (f"{r['speedup']:.2f}x at k={r['k']} (alpha {r['alpha']:.2f}, c {r['c']:.3f}, "
                                        f"formula {r['predicted']:.2f}x, with the measured v "
                                        f"{r['predicted_with_verify_cost']:.2f}x)")
        lines.append(f"- {t['proposer']} on {t['task']}: goal >= {t['goal']}x, best {best}: **{t['status']}**")
    for name, why in result["skipped"].items():
        lines.append(f"- {name} skipped: {why}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = ["grounded", "chat"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, task in zip(axes, tasks):
        for i, name in enumerate(n for n in PROPOSERS if n in result["cost_ratio"]):
            rows = [r for r in result["rows"] if r["task"] == task and r["proposer"] == name]
            color = f"C{i}"
            ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], "o-", color=color, label=f"{name} measured")
            ax.plot([r["k"] for r in rows], [r["predicted_with_verify_cost"] for r in rows], "x--", color=color,
                    label=f"{name} predicted (measured v)")
            ax.plot([r["k"] for r in rows], [r["predicted"] for r in rows], ":", color=color, alpha=0.6,
                    label=f"{name} predicted (v = 1)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{task} task, batch 1")
        ax.set_xlabel("draft tokens per step (k)")
    axes[0].set_ylabel("decode speedup over plain decoding")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


CLOCK_NOTE = {"cpu": "Times are this process's CPU seconds (one thread, no I/O: what wall time would be on an idle "
                     "machine; wall time would also count the other programs' turns on the shared cores).",
              "wall": "Times are wall-clock seconds."}

INTRO = ("Batch-1 decoding with speculation: n-gram prompt lookup and draft models, measured speedup beside the "
         "formula (1 - alpha^(k+1)) / ((1 - alpha)(v + k c)) with the measured per-token acceptance alpha, draft cost "
         "ratio c and verify cost v (v = 1 in Leviathan et al., 2023). "
         "The helpers are in `minfer/lab/bench/spec.py` (notebook 07 uses them too).")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 prompt per task, 24 tokens, k in {2, 4}")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (faster at batch 1 on this CPU) or float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], help="what the timings count: this process's CPU time "
                        "(default on a CPU device, with one thread: immune to other programs sharing the machine) "
                        "or wall time (default elsewhere)")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per task (full run)")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--ks", type=int, nargs="+", help="draft lengths (default 1 2 4 6)")
    parser.add_argument("--proposers", nargs="+", default=list(PROPOSERS), help=f"default: {' '.join(PROPOSERS)}")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot")
    parser.add_argument("--update-docs", nargs="?", const=str(DOCS_PAGE), default=None, metavar="PATH")
    args = parser.parse_args(argv)
    command = "OMP_NUM_THREADS=1 python benchmarks/bench_speculative.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.time()
    result = run(args)
    result["command"], result["wall_s"] = command, time.time() - started
    markdown = format_markdown(result, command)
    if args.plot:
        plot(result, args.plot)
        markdown += f"\n![speculative decoding]({Path(args.plot).name})\n"
    print(markdown)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.update_docs:
        write_docs_section(markdown, args.update_docs, DOCS_START, DOCS_END,
                            heading="## Speculative decoding (batch 1)", intro=INTRO)
    return 0


if __name__ == "__main__":
    sys.exit(main())
