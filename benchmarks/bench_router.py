"""The router on checkable tasks: which cheap model, which confidence signal, and the cost-accuracy trade-off.

    OMP_NUM_THREADS=1 python benchmarks/bench_router.py --json docs/bench_router.json --update-docs

Full model: SmolLM2-135M-Instruct. Every task of `minfer.lab.router_tasks.make_tasks` (arithmetic of
growing size, copying, formatting, facts; each with a checker) is answered greedily, through the
chat template, by the full model and by each cheap candidate (`minfer.lab.bench.router.CHEAP_MODELS`). For
each candidate: its accuracy, its cost ratio c (one decode step against the full model's, batch 1,
`minfer.lab.bench.spec.cost_ratio`), and how well each confidence signal separates its right answers
from its wrong ones (AUC). The candidate and signal whose cheapest threshold keeps the full model's
accuracy costs least (counting the cheap attempt every request pays) is the operating point; the
threshold sweep of that pair is the table. Costs are given two ways: by the formula with the
measured c, and as measured time: the seconds the routed run would spend (every cheap attempt plus
the escalated full answers) over the seconds of answering everything with the full model.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from minfer import LLM
from minfer.lab.bench.common import machine_info, write_docs_section
from minfer.lab.bench.router import CHEAP_MODELS, RouterStudy, build_cheap_model, cheapest_study, study_router
from minfer.lab.router_tasks import answer_tasks, make_tasks

DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"  # this checkout's docs page
DOCS_START, DOCS_END = "<!-- bench_router:start -->", "<!-- bench_router:end -->"


def run(per_kind: int, max_tokens: int, candidates: list[str], dtype: str) -> dict:
    llm = LLM("smollm2-135m", dtype=dtype, device="cpu")
    tokenizer, full = llm.get_tokenizer(), llm.model
    tasks = make_tasks(per_kind)
    full_rows = answer_tasks(full, tokenizer, tasks, max_tokens)
    studies: dict[str, RouterStudy] = {}
    cheap_rows = {}
    for name in candidates:
        cheap = build_cheap_model(name, full, tokenizer)
        cheap_rows[name] = answer_tasks(cheap, tokenizer, tasks, max_tokens)
        studies[name] = study_router(name, cheap, full, cheap_rows[name], full_rows)
        del cheap
    best = cheapest_study(list(studies.values()))
    return {"machine": machine_info()["cpu"], "threads": torch.get_num_threads(),
            "dtype": dtype, "max_tokens": max_tokens, "num_tasks": len(tasks),
            "full_accuracy": best.full_accuracy, "candidates": {n: s.summary() for n, s in studies.items()},
            "chosen": best.name, "operating_point": best.operating_point.__dict__,
            "timed_cost": best.timed_cost(best.operating_point), "full_rows": full_rows, "cheap_rows": cheap_rows}


def saved_studies(result: dict) -> dict[str, RouterStudy]:
    """The studies of a run, rebuilt from its rows (so that a saved --json run renders the same tables)."""
    return {name: RouterStudy(name, summary["cost_ratio"], result["cheap_rows"][name], result["full_rows"],
                              summary["signal"]) for name, summary in result["candidates"].items()}


def sweep_lines(study: RouterStudy) -> list[str]:
    op = study.operating_point
    lines = ["| threshold | routed cheap | accuracy | misrouted (cheap wrong, full right) | wasted escalations | "
             "cost s·c + (1−s) | cost c + (1−s) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in study.sweep_table():
        mark = " (operating point)" if r.threshold == op.threshold and op.share_cheap > 0 else ""
        lines.append(f"| {r.threshold:.3f}{mark} | {r.share_cheap:.0%} | {r.accuracy:.1%} | {r.misrouted} | "
                     f"{r.wasted_escalations} | {r.cost:.2f} | {r.cost_with_classifier:.2f} |")
    return lines


def markdown(result: dict, command: str) -> str:
    n, full_acc = result["num_tasks"], result["full_accuracy"]
    studies = saved_studies(result)
    best = studies[result["chosen"]]
    op = best.operating_point
    lines = [f"Command: `{command}` ({result['threads']} torch thread, {result['dtype']}, answers of at most "
             f"{result['max_tokens']} tokens). {n} checkable tasks made in code (`minfer/lab/router_tasks.py`: arithmetic "
             f"of growing size, copying, formatting, facts); an answer is right when it contains the result. The full "
             f"model (SmolLM2-135M-Instruct) answers {full_acc:.1%} of them right.", "",
             "| cheap model | accuracy | c (decode step vs full) | AUC min_prob | AUC mean_prob | AUC first_margin | "
             "cheapest cost at the full model's accuracy (signal, share cheap) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in studies.items():
        auc = [f"{s.auc(k):.2f}" if s.auc(k) is not None else "–" for k in ("min_prob", "mean_prob", "first_margin")]
        point = s.operating_point
        lines.append(f"| {name} | {s.accuracy:.1%} | {s.cost_ratio:.2f} | {' | '.join(auc)} | "
                     f"{point.cost_with_classifier:.2f} ({s.signal}, {point.share_cheap:.0%}) |")
    lines += ["", "AUC: the chance that a right cheap answer is more confident than a wrong one (0.5: the signal does "
              "not separate). Cost counts the cheap attempt every request pays, c + (1 − s), since the classifier "
              "is the cheap model's own confidence; below 1 the router saves.", "",
              f"Operating point: **{best.name}**, signal {best.signal}, threshold {op.threshold:.3f}: "
              f"{op.share_cheap:.0%} served cheap at {op.accuracy:.1%} accuracy; cost {op.cost:.2f} by s·c + (1−s), "
              f"{op.cost_with_classifier:.2f} counting the cheap attempt, {result['timed_cost']:.2f} in measured "
              f"seconds (the routed run's answers over the full model's). Beside it the textbook example, 70 % cheap "
              f"at c = 0.1: 0.7 × 0.1 + 0.3 × 1 = 0.37."]
    for s in studies.values():  # the sweeps worth reading: candidates that get at least half of what the full model gets
        if s.accuracy >= full_acc / 2 and s.routable:
            lines += ["", f"Threshold sweep, {s.name} (signal {s.signal}, c = {s.cost_ratio:.2f}):", ""] + sweep_lines(s)
    lines += ["", f"Per kind of task at the operating point ({best.name}):", "",
              "| kind | full model right | cheap model right | routed cheap | served right |",
              "|---|---:|---:|---:|---:|"]
    for kind, k in best.by_kind().items():
        lines.append(f"| {kind} | {k['full_right']}/{k['n']} | {k['cheap_right']}/{k['n']} | {k['routed_cheap']} | "
                     f"{k['served_right']}/{k['n']} |")
    lines += ["", "Why the textbook saving does not appear here: the only candidate as accurate as the full model "
              "(int8) is not much cheaper per step, so its best use is to serve everything, which is quantization, "
              "not routing; the cheaper int4 model loses accuracy on requests its confidence does not flag (AUC near "
              "0.5 to 0.6), so keeping the full model's accuracy means escalating most requests, and each escalated "
              "one pays the cheap attempt too. The distilled draft and the truncated model cost little but answer "
              "almost nothing right: a whole answer needs every token, where speculative decoding corrects each miss."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-kind", type=int, default=10, help="tasks per kind (12 kinds; the fact kinds stop at "
                                                                 "the facts listed)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--candidates", nargs="+", default=list(CHEAP_MODELS), choices=CHEAP_MODELS)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--update-docs", nargs="?", const=str(DOCS_PAGE), default=None, metavar="PATH")
    parser.add_argument("--render", metavar="JSON", help="measure nothing: render the tables of a saved --json run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
    else:
        result = run(args.per_kind, args.max_tokens, args.candidates, args.dtype)
    command = "python benchmarks/bench_router.py --json docs/bench_router.json --update-docs"
    text = markdown(result, command)
    print(text)
    if args.json_path and not args.render:
        with open(args.json_path, "w") as f:
            json.dump(result, f)
    if args.update_docs:
        write_docs_section(text, args.update_docs, DOCS_START, DOCS_END,
                           heading="## Routing: easy requests to a cheap model")


if __name__ == "__main__":
    main()
