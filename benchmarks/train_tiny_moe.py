"""A tiny byte-level LM trained dense and as Switch-style MoEs of the same active compute (chapter 10).

    OMP_NUM_THREADS=1 python benchmarks/train_tiny_moe.py                  # about 4 minutes on one core
    OMP_NUM_THREADS=1 python benchmarks/train_tiny_moe.py --steps 60       # a quick check

Four runs of `minfer.moe.tiny` on pydoc text outside the evaluation topics: dense (d_ff = F);
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

from minfer.bench.common import machine_info
from minfer.moe.tiny import TinyConfig, byte_splits, dropped_share, evaluate, expert_load, train

CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--json", default=str(Path(__file__).resolve().parent.parent / "docs" / "tiny_moe.json"))
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
