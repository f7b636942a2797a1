"""A tiny byte-level LM trained dense and as Switch-style MoEs of the same active compute (chapter 10).

    OMP_NUM_THREADS=1 python benchmarks/train_tiny_moe.py                  # about 4 minutes on one core
    OMP_NUM_THREADS=1 python benchmarks/train_tiny_moe.py --steps 60       # a quick check

Four runs of `minfer.lab.tiny_moe` on pydoc text outside the evaluation topics: dense (d_ff = F);
E experts of size F, top-1, with Switch's load-balancing loss; the same without it; and with it
plus a capacity factor of 1.0 during training (tokens beyond an expert's capacity dropped).
Written to docs/tiny_moe.json: validation loss against training FLOPs, parameter counts, each
MoE layer's expert load on the validation text, and the share of assignments a capacity factor
would drop, for the models trained with and without the balancing loss. No weights are kept.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minfer.lab.bench.common import machine_info, write_docs_section
from minfer.lab.tiny_moe import TinyConfig, byte_splits, dropped_share, evaluate, expert_load, train

CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DOCS_START, DOCS_END = "<!-- train_tiny_moe:start -->", "<!-- train_tiny_moe:end -->"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent.parent / "docs" / "tiny_moe.json"))
    parser.add_argument("--update-docs", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--from-json", action="store_true", help="no training: the docs table from the stored --json")
    args = parser.parse_args()
    if args.from_json:
        write_docs_section(markdown(json.loads(Path(args.json).read_text())), DOCS_PAGE, DOCS_START, DOCS_END,
                           "## Mixture of experts: a tiny MoE trained against a dense model")
        return
    torch.set_num_threads(1)
    data = byte_splits()
    switch = TinyConfig(num_experts=args.experts, top_k=1, aux_loss_coef=0.01)
    runs = {"dense": TinyConfig(), "switch, balancing loss": switch,
            "switch, no balancing loss": replace(switch, aux_loss_coef=0.0),
            "switch, balancing loss, capacity 1.0": replace(switch, capacity_factor=1.0)}
    start, results = time.perf_counter(), {}
    for name, config in runs.items():
        with tqdm(total=args.steps, desc=name) as bar:
            run = train(config, data, steps=args.steps, progress=lambda step: bar.update(1))
        model = run.pop("model")
        if config.num_experts:
            routings = evaluate(model, data["val"])["routings"]
            run["expert_load"] = expert_load(routings, config.num_experts)
            run["dropped_share"] = {str(cf): dropped_share(routings, config.num_experts, config.top_k, cf)
                                    for cf in CAPACITY_FACTORS}
        results[name] = run
        print(f"{name}: val loss {run['curve'][-1]['val_loss']:.3f}, {run['total_params']:,} parameters "
              f"({run['active_params']:,} active), {run['curve'][-1]['seconds']:.0f} s")
    out = {"command": "OMP_NUM_THREADS=1 python benchmarks/train_tiny_moe.py" + (f" --steps {args.steps}" if args.steps != 400 else ""),
           "machine": machine_info(), "steps": args.steps, "seconds": time.perf_counter() - start, "runs": results,
           "train_bytes": len(data["train"]), "val_bytes": len(data["val"])}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.json)
    if args.update_docs:
        write_docs_section(markdown(out), DOCS_PAGE, DOCS_START, DOCS_END,
                           "## Mixture of experts: a tiny MoE trained against a dense model")


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [f"Command: `{out['command']} --update-docs`; {m.get('cpu', 'CPU')}, one torch thread, on a 2-core machine "
             f"shared with other jobs (load average {m.get('load_average_1min', '?')}): {out['seconds'] / 60:.0f} minutes "
             "(about 4 on a quiet core). Byte-level, 2 layers, 128 wide, context 64, batch 32, "
             f"{out['steps']} steps; {out['train_bytes']:,} training bytes, {out['val_bytes']:,} validation bytes "
             "(pydoc topics outside the evaluation set). Validation loss in nats per byte.", "",
             "| run | parameters | active | final val loss | busiest expert (last layer) | dropped at capacity 1.0 / 1.25 |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, run in out["runs"].items():
        busiest = f"{max(run['expert_load'][-1]):.0%}" if "expert_load" in run else ""
        dropped = (f"{run['dropped_share']['1.0']:.0%} / {run['dropped_share']['1.25']:.0%}"
                   if "dropped_share" in run else "")
        lines.append(f"| {name} | {run['total_params']:,} | {run['active_params']:,} | "
                     f"{run['curve'][-1]['val_loss']:.3f} | {busiest} | {dropped} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
