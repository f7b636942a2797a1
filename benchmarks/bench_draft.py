"""A drafting proposer, this checkout's beside another version of it, in one process.

    git show REV:minfer/speculative/draft_model.py > BEFORE.py    # REV: the version to compare with
    OMP_NUM_THREADS=1 python benchmarks/bench_draft.py --baseline BEFORE.py [--rounds 3]
    git show REV:minfer/speculative/eagle.py > BEFORE.py
    OMP_NUM_THREADS=1 python benchmarks/bench_draft.py --proposer smollm2-135m-eagle --baseline BEFORE.py

SmolLM2-135M (bfloat16) with the distilled draft (`smollm2-135m-draft`, the module's DraftModelProposer) or the
EAGLE head (`smollm2-135m-eagle`, its EagleProposer), k guesses, greedy, on the CPU with one thread. Two settings:
batch 1 (chapter 07's measurement, `decode_rate`: each chat prompt alone, decode tokens/s from this process's CPU
time), and --batch chat prompts generated together (`LLM.generate`, CPU seconds for the whole call), where a
proposer that drafts every sequence in one batched step should gain. Both proposers share the draft's weights and
alternate round by round; each keeps its best round. Plain decoding is timed in every round too.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.lab.bench.common import machine_info  # noqa: E402
from minfer.lab.bench.spec import chat_prompts, decode_rate  # noqa: E402
from minfer.speculative import make_proposer  # noqa: E402


def baseline_proposer(path: str, current):
    """The same proposer built from another version of its module (a draft model's or an EAGLE head's)."""
    spec = importlib.util.spec_from_file_location("proposer_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    if hasattr(current, "head"):
        return module.EagleProposer(current.head, current.vocab_size)
    return module.DraftModelProposer(current.model, current.vocab_size)


def batch_seconds(llm, proposer, k: int, prompts: list, max_tokens: int) -> tuple[float, list]:
    engine = llm.engine
    engine.proposer, engine.num_speculative_tokens = proposer, k if proposer is not None else 0
    start = time.process_time()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return time.process_time() - start, [o.outputs[0].token_ids for o in outputs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--proposer", default="smollm2-135m-draft", choices=["smollm2-135m-draft", "smollm2-135m-eagle"])
    parser.add_argument("--baseline", required=True,
                        help="another version of the proposer's module (draft_model.py or eagle.py) to time beside this checkout's")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="chat prompts decoded one at a time (batch 1)")
    parser.add_argument("--batch", type=int, default=8, help="chat prompts decoded together")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM("smollm2-135m", dtype="bfloat16", device="cpu", enable_prefix_caching=False)
    current = make_proposer(args.proposer, llm.model, llm.tokenizer, llm.max_model_len, llm.dtype, llm.device)
    proposers = {"baseline": baseline_proposer(args.baseline, current), "this checkout": current}
    alone, together = chat_prompts(llm, args.prompts), chat_prompts(llm, args.batch)
    rates: dict[str, list[float]] = {name: [] for name in ("plain", *proposers)}
    seconds: dict[str, list[float]] = {name: [] for name in ("plain", *proposers)}
    alphas, tokens = {}, {}
    for _ in range(args.rounds):
        rates["plain"].append(decode_rate(llm, alone, args.max_tokens, clock="cpu")["tokens_per_s"])
        seconds["plain"].append(batch_seconds(llm, None, 0, together, args.max_tokens)[0])
        for name, proposer in proposers.items():
            run = decode_rate(llm, alone, args.max_tokens, proposer, args.k, clock="cpu")
            rates[name].append(run["tokens_per_s"])
            alphas[name] = run["spec"]["alpha"]
            spent, tokens[name] = batch_seconds(llm, proposer, args.k, together, args.max_tokens)
            seconds[name].append(spent)
    info = machine_info()
    print(f"SmolLM2-135M (bfloat16) with {args.proposer}, k={args.k}, greedy, up to {args.max_tokens} tokens; "
          f"{info['cpu']}, 1 torch thread; best of {args.rounds} alternating rounds\n")
    print(f"| proposer | batch 1: decode tokens/s ({args.prompts} chat prompts, one at a time) | vs plain | alpha | "
          f"batch {args.batch}: CPU seconds for {args.batch} chat prompts together | vs plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in rates:
        rate, spent = max(rates[name]), min(seconds[name])
        alpha = f"{alphas[name]:.3f}" if name in alphas else "-"
        print(f"| {name} | {rate:.2f} | {rate / max(rates['plain']):.2f}x | {alpha} | {spent:.2f} | "
              f"{min(seconds['plain']) / spent:.2f}x |")
    print(f"\nthis checkout / baseline: batch 1 {max(rates['this checkout']) / max(rates['baseline']):.2f}x, "
          f"batch {args.batch} {min(seconds['baseline']) / min(seconds['this checkout']):.2f}x; "
          f"the same tokens at batch {args.batch}: {tokens['baseline'] == tokens['this checkout']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
