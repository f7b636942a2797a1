"""Quantization-aware fine-tuning of SmolLM2-135M for int4 g64 (`minfer.lab.qat`), measured before and after.

    OMP_NUM_THREADS=1 python benchmarks/train_qat.py --json docs/qat.json     # writes the int4 checkpoint too
    OMP_NUM_THREADS=1 python benchmarks/train_qat.py --quick --out /tmp/qat   # a smoke run

Steps, all on the CPU with fixed seeds, nothing downloaded:
  1. sensitivity: the perplexity (a short slice of the evaluation text, bare model) with only one kind
     of matrix rounded to int4 g64, to choose what to train;
  2. fine-tune: every matrix fake-quantized, the chosen ones (default qkv_proj and down_proj) trained
     with straight-through gradients to match the float model's logits (KL), on pydoc topics kept
     apart from the evaluation text (`minfer.lab.qat.training_topics`), bfloat16 autocast;
  3. quantize the tuned weights to plain int4 g64 and save the checkpoint (`--out`, default
     `minfer.lab.qat.default_checkpoint_dir()`, outside the repository: about 200 MB, the float32 embedding
     being 113 MB of it);
  4. measure through the engine (`minfer.lab.evaluate`, the benchmark's full preset): perplexity and
     greedy agreement of the float model, plain int4 g64 and the QAT int4 g64 model, and each kind of
     matrix's quantization error; all written to --json with the loss curve and the times.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from minfer import LLM
from minfer.lab.bench.common import machine_info
from minfer.lab.evaluate import EVAL_PROMPTS, eval_tokens, greedy_agreement, greedy_reference, perplexity
from minfer.models.llama import LlamaModel
from minfer.models.loader import load_model
from minfer.quant.awq import fake_quantize_int4
from minfer.quant.checkpoint import save_quantized
from minfer.quant.linear import quantize_model
from minfer.lab.qat import (LINEAR_NAMES, default_checkpoint_dir, finish_qat, model_perplexity, prepare_qat,
                              quantization_errors, train_qat, training_rows)


def sensitivity(model: LlamaModel, token_ids: list[int], group_size: int) -> dict[str, float]:
    """Perplexity (bare model, bf16) with nothing, each kind of matrix alone, or all of them rounded to int4."""
    out = {"none": model_perplexity(model, token_ids, bf16=True)}
    for kind in LINEAR_NAMES + ("all",):
        rounded = copy.deepcopy(model)
        with torch.no_grad():
            for layer in rounded.layers:
                for block in (layer.self_attn, layer.mlp):
                    for name, linear in block.named_children():
                        if kind in (name, "all"):
                            linear.weight.copy_(fake_quantize_int4(linear.weight, group_size))
        out[kind] = model_perplexity(rounded, token_ids, bf16=True)
        print(f"  only {kind} in int4: perplexity {out[kind]:.3f} ({out[kind] / out['none'] - 1:+.1%})")
    return out


def engine_quality(path: str, reference, args, **llm_args) -> dict:
    llm = LLM(path, dtype="bfloat16", device="cpu", seed=0, kv_cache_memory_bytes=2**29, **llm_args)
    row = {"perplexity": perplexity(llm, args.eval_tokens, 512, 256), "greedy_agreement": greedy_agreement(llm, reference)}
    del llm
    return row


def engine_comparison(checkpoint: str, args) -> tuple[dict, float]:
    """Perplexity and greedy agreement of the float model, plain int4 g64 and the QAT checkpoint, by the engine."""
    base = LLM("smollm2-135m", dtype="bfloat16", device="cpu", seed=0, kv_cache_memory_bytes=2**29)
    reference = greedy_reference(base, EVAL_PROMPTS, 32)
    del base
    quality = {"none": engine_quality("smollm2-135m", reference, args),
               "int4 g64": engine_quality("smollm2-135m", reference, args, quantization="int4",
                                          quantization_group_size=64),
               "qat g64": engine_quality(checkpoint, reference, args)}
    none, plain_ppl, qat_ppl = (quality[k]["perplexity"] for k in ("none", "int4 g64", "qat g64"))
    recovered = (plain_ppl - qat_ppl) / (plain_ppl - none)
    for name, row in quality.items():
        print(f"  {name}: perplexity {row['perplexity']:.3f} ({row['perplexity'] / none - 1:+.2%}), "
              f"greedy agreement {row['greedy_agreement']:.3f}")
    print(f"  QAT recovers {recovered:.1%} of plain int4 g64's perplexity increase (target >= 50 %)")
    return quality, recovered


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(default_checkpoint_dir()), help="the QAT int4 checkpoint to write")
    parser.add_argument("--json", dest="json_path", help="write the measurements here (e.g. docs/qat.json)")
    parser.add_argument("--trainable", default="qkv_proj,down_proj", help=f"matrices to train, of {LINEAR_NAMES}")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--watch-every", type=int, default=40,
                        help="every so many steps, the fake-quantized model's perplexity on 512 evaluation tokens")
    parser.add_argument("--no-sensitivity", action="store_true", help="skip step 1")
    parser.add_argument("--no-engine", action="store_true",
                        help="skip step 4 (benchmarks/bench_quant.py measures the 'qat g64' row the same way)")
    parser.add_argument("--eval-tokens", type=int, default=4096, help="evaluation tokens (the benchmark's full preset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny run to check the pipeline")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_tokens = 4, 512
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    group_size, start, cpu_start = 64, time.perf_counter(), time.process_time()
    loaded = load_model("smollm2-135m", torch.float32)
    teacher = LlamaModel.from_weights(loaded.config, loaded.weights)
    tokenizer = loaded.tokenizer
    del loaded

    print("1. sensitivity (1024 evaluation tokens, bare model):")
    sens = {} if args.quick or args.no_sensitivity else sensitivity(teacher, eval_tokens(tokenizer, 1024), group_size)

    print("2. fine-tuning")
    model = copy.deepcopy(teacher)
    params = prepare_qat(model, args.trainable.split(","), group_size)
    rows = training_rows(tokenizer, args.seq_len, args.seed)
    batches = [rows[i: i + args.batch_size] for i in range(0, len(rows) - args.batch_size + 1, args.batch_size)]
    watch_ids, watched = eval_tokens(tokenizer, 512), {}

    def on_step(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        if step % args.watch_every == 0 or step == args.steps:
            watched[step] = model_perplexity(model, watch_ids, bf16=True)
            bar.write(f"  step {step}: loss {loss:.4f}, perplexity (512 evaluation tokens) {watched[step]:.3f}")

    watch_float = model_perplexity(teacher, watch_ids, bf16=True)
    watched[0] = model_perplexity(model, watch_ids, bf16=True)
    print(f"  perplexity (512 evaluation tokens): float {watch_float:.3f}, int4 g64 before QAT {watched[0]:.3f}")
    bar = tqdm(total=args.steps, desc="QAT")
    train_start, train_cpu = time.perf_counter(), time.process_time()
    losses = train_qat(model, teacher, params, batches, args.steps, args.lr, bf16=True, on_step=on_step)
    bar.close()
    train_wall, train_cpu = time.perf_counter() - train_start, time.process_time() - train_cpu
    finish_qat(model)

    print("3. int4 g64 of the tuned weights ->", args.out)
    tuned = copy.deepcopy(model)  # the tuned float weights, for the error against them
    quantize_model(model, "int4", group_size, backend="reference")
    save_quantized(model, args.out, tokenizer)
    plain = quantize_model(copy.deepcopy(teacher), "int4", group_size, backend="reference")
    errors = {"plain int4 g64 vs float": quantization_errors(teacher, plain),
              "qat int4 g64 vs float": quantization_errors(teacher, model),
              "qat int4 g64 vs its tuned weights": quantization_errors(tuned, model)}
    del plain, tuned, model, teacher

    for name, per_matrix in errors.items():
        print(f"  relative weight error, {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in per_matrix.items()))
    quality, recovered = ({}, None) if args.no_engine else engine_comparison(args.out, args)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(f"training {train_wall:.0f} s wall, {train_cpu:.0f} s CPU ({args.steps} steps); "
          f"all {wall:.0f} s wall, {cpu:.0f} s CPU")
    if args.json_path:
        result = {"command": "python benchmarks/train_qat.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "machine": machine_info("cpu"), "args": vars(args), "sensitivity": sens, "losses": losses,
                  "watched_perplexity": watched, "watched_float_perplexity": watch_float,
                  "quality": quality, "recovered": recovered, "weight_errors": errors,
                  "train_wall_s": train_wall, "train_cpu_s": train_cpu, "wall_s": wall, "cpu_s": cpu}
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
