"""How many engine steps static and continuous batching take for chapter 04's GPU workloads.

    python benchmarks/batching_steps.py                        # token budgets of 512 (the default) and 2048

Where every step costs about the same whatever it holds (an eager step on a GPU, bound by its kernel launches:
docs/gpu/ch00.json), throughput follows the number of steps. That number is the scheduler's alone, the same on any
device, so this script counts it on the CPU with a tiny random model (the SmolLM2 tokenizer), for the workloads of
chapter 04's GPU cell: 2 x max_num_seqs requests, prompts of 32 to 256 tokens, 8 to 128 output tokens (EOS ignored).
Static batching takes, per batch, one prefill step and then a step per token of its longest output.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from typing import Optional

import torch

from minfer import LLM
from minfer.lab.bench.serving_engines import run_minfer
from minfer.lab.bench.serving_workload import make_workload
from minfer.models.loader import load_tokenizer
from minfer.lab.testing import MODEL_SHAPES, random_checkpoint


def tiny_llm(vocab_size: int, max_num_batched_tokens: int) -> LLM:
    """A 2-layer, 64-wide random Llama taking the tokenizer's ids, and a pool that never preempts these workloads."""
    shape = dataclasses.replace(MODEL_SHAPES["tiny"], vocab_size=vocab_size, max_position_embeddings=2048)
    with tempfile.TemporaryDirectory() as folder:  # the LLM holds what it read: the checkpoint can go
        return LLM(random_checkpoint(folder, shape), dtype="float32", device="cpu",
                   num_gpu_blocks_override=8192, max_num_batched_tokens=max_num_batched_tokens)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256], help="max_num_seqs values")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048], help="max_num_batched_tokens values")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer("smollm2-135m")
    print("| max_num_seqs | requests | prompt tokens | static steps | token budget | continuous steps | static / continuous |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for budget in args.budgets:
        llm = tiny_llm(len(tokenizer), budget)
        for size in args.sizes:
            workload = make_workload(tokenizer, 2 * size, prompt_len=(32, 256), output_len=(8, 128), seed=size)
            batches = [workload[i:i + size] for i in range(0, len(workload), size)]
            static = sum(max(r.max_tokens for r in batch) for batch in batches)  # 1 prefill + (longest - 1) decodes
            continuous = run_minfer(llm, workload, "continuous", max_num_seqs=size)
            if continuous["preemptions"]:
                raise RuntimeError(f"{continuous['preemptions']} preemptions: the pool is too small to count steps cleanly")
            prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
            print(f"| {size} | {len(workload)} | {prompt_tokens} | {static} | {budget} | {continuous['steps']} | "
                  f"{static / continuous['steps']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
