"""Tensor parallelism measured: SmolLM2-135M at tensor_parallel_size 1 and 3 on this machine, step by
step (all-reduce count, bytes and time per step, tokens/s), beside a paper estimate for a 70B model on
8 GPUs linked by NVLink. Writes docs/bench_parallel.json.

    OMP_NUM_THREADS=1 python benchmarks/bench_parallel.py [--prompts 8 --max-tokens 32]

The formulas (all-reduce bytes per token, ring time, memory per device) are chapter 11's worked
solutions, `solutions/ch11_scaling_out.py`: one implementation for the benchmark, the notebook and
the exercise tests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for solutions/
from solutions.ch11_scaling_out import (all_reduce_per_token, all_reduce_seconds, kv_cache_bytes_per_device,  # noqa: E402
                                        weight_bytes_per_device)

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.lab.bench.common import machine_info  # noqa: E402
from minfer.config import ModelConfig  # noqa: E402

# Llama-3.1-70B's shape, and the hardware of an 8-GPU NVLink node (H100 SXM: 900 GB/s NVLink per
# GPU, both directions together, so 450 GB/s each way; 3.35 TB/s HBM3). The all-reduce latency is an
# assumption: NCCL's small-message all-reduce inside one node takes some microseconds.
LLAMA_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                        num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                        max_position_embeddings=131072, tie_word_embeddings=False)
NVLINK_BYTES_PER_S = 450e9
HBM_BYTES_PER_S = 3.35e12
ALL_REDUCE_LATENCY_S = 10e-6


def chat_prompts(llm: LLM, n: int) -> list[dict]:
    topics = ["the sky", "rain", "a CPU", "tea", "Python lists", "the moon", "bread", "music", "a bicycle", "snow"]
    return [llm.chat_prompt([{"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."}])
            for i in range(n)]


def run(llm: LLM, prompts: list[dict], max_tokens: int) -> dict:
    """Step the engine by hand and record every step: its time, its rows, and the communication in it."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    engine, steps = llm.engine, []
    llm.add_requests(prompts, params)
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        before = engine.snapshot()
        t = time.perf_counter()
        llm.step()
        seconds, after = time.perf_counter() - t, engine.snapshot()
        step = {"seconds": seconds, "rows": after.computed_tokens + after.padding_tokens - before.computed_tokens
                - before.padding_tokens}
        if after.communication:  # tensor parallelism: this step's collectives
            step.update({name: getattr(after.communication, name) - getattr(before.communication, name)
                         for name in ("all_reduces", "all_reduce_bytes", "all_reduce_seconds", "broadcast_seconds",
                                      "broadcast_bytes")})
        steps.append(step)
    elapsed = time.perf_counter() - start
    decode = [s for s in steps if s["rows"] <= 32]  # decode steps: one row per sequence (bucketed)
    summary = {"output_tokens": len(prompts) * max_tokens, "seconds": elapsed,
               "tokens_per_s": len(prompts) * max_tokens / elapsed, "steps": len(steps),
               "decode_steps": len(decode), "decode_step_ms": 1e3 * statistics.median(s["seconds"] for s in decode)}
    if "all_reduces" in steps[0]:
        summary.update(
            all_reduces_per_step=statistics.median(s["all_reduces"] for s in decode),
            all_reduce_bytes_per_decode_step=statistics.median(s["all_reduce_bytes"] for s in decode),
            all_reduce_ms_per_decode_step=1e3 * statistics.median(s["all_reduce_seconds"] for s in decode),
            all_reduce_us_each=1e6 * sum(s["all_reduce_seconds"] for s in decode) / sum(s["all_reduces"] for s in decode),
            broadcast_ms_per_decode_step=1e3 * statistics.median(s["broadcast_seconds"] for s in decode),
            broadcast_bytes_per_decode_step=statistics.median(s["broadcast_bytes"] for s in decode),
            decode_rows=statistics.median(s["rows"] for s in decode))
    return summary


def _bare_rank(rank: int, n: int, port: int, numel: int, iters: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    x, times = torch.ones(numel), []
    for _ in range(iters):
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def bare_all_reduce_us(n: int, numel: int, iters: int = 300) -> float:
    """gloo's all-reduce alone: n processes doing nothing else, median microseconds (rank 0's view)."""
    import torch.multiprocessing as mp

    from minfer.engine.parallel import free_port

    context = mp.get_context("spawn")
    out, port = context.Queue(), free_port()
    procs = [context.Process(target=_bare_rank, args=(r, n, port, numel, iters, out)) for r in range(n)]
    for p in procs:
        p.start()
    median = out.get(timeout=300)
    for p in procs:
        p.join()
    return median * 1e6


def paper_70b(n: int = 8, batch: int = 1) -> dict:
    """A decode step of Llama-3.1-70B in bfloat16 over n NVLink GPUs, at `batch` sequences."""
    count, payload, ring = all_reduce_per_token(LLAMA_70B.num_layers, LLAMA_70B.hidden_size, n, 2)
    one = all_reduce_seconds(batch * payload / count, n, NVLINK_BYTES_PER_S, ALL_REDUCE_LATENCY_S)
    weights = weight_bytes_per_device(LLAMA_70B, n, 2)
    weights_s = weights / HBM_BYTES_PER_S  # decode reads every weight once per step
    return {"model": "Llama-3.1-70B, bfloat16", "devices": n, "batch": batch, "all_reduces_per_step": count,
            "bytes_per_all_reduce": batch * payload / count, "ring_bytes_sent_per_device_per_step": batch * ring,
            "link_GB_per_s": NVLINK_BYTES_PER_S / 1e9, "latency_us": ALL_REDUCE_LATENCY_S * 1e6,
            "all_reduce_us_each": one * 1e6, "all_reduce_ms_per_step": count * one * 1e3,
            "per_layer_us": 2 * one * 1e6, "weight_GB_per_device": weights / 1e9,
            "weight_read_ms_per_step": weights_s * 1e3, "kv_GB_per_device_128k_tokens":
                kv_cache_bytes_per_device(LLAMA_70B, n, 131072, 2) / 1e9,
            "communication_share": count * one / (count * one + weights_s)}


def bare(rows: int) -> dict:
    """The all-reduce of one decode step's rows (float32 [rows, 576]) alone, with 3 processes, and with 2 (one per core)."""
    return {"rows": rows, "load_average": os.getloadavg()[0],
            **{f"n{n}": bare_all_reduce_us(n, rows * 576) for n in (2, 3)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default="docs/bench_parallel.json")
    parser.add_argument("--bare-only", action="store_true", help="only the bare all-reduce, added to the saved JSON")
    args = parser.parse_args()
    if args.bare_only:
        results = json.loads(Path(args.json).read_text())
        results["bare_all_reduce_us"] = bare(args.prompts)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(results["bare_all_reduce_us"])
        return
    results = {"command": "OMP_NUM_THREADS=1 python benchmarks/bench_parallel.py " + " ".join(sys.argv[1:]),
               "machine": machine_info(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "load_average_at_start": os.getloadavg(), "runs": {}}
    for n in (1, 3):
        llm = LLM("smollm2-135m", dtype="float32", device="cpu", tensor_parallel_size=n)
        results["runs"][f"tp{n}"] = run(llm, chat_prompts(llm, args.prompts), args.max_tokens)
        print(n, json.dumps(results["runs"][f"tp{n}"], indent=1), flush=True)
        if n > 1:
            llm.engine.runner.workers.shutdown()
        del llm
    count, payload, _ = all_reduce_per_token(30, 576, 3, 4)
    results["smollm2_formula"] = {"all_reduces_per_step": count, "bytes_per_token_per_step": payload}
    results["bare_all_reduce_us"] = bare(args.prompts)
    results["paper_70b"] = {f"batch{b}": paper_70b(8, b) for b in (1, 64)}
    results["load_average_at_end"] = os.getloadavg()
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["paper_70b"], indent=1))


if __name__ == "__main__":  # workers are spawned: they import this file again, and must not run it
    main()
