"""The quantization benchmark: what each format costs in quality and buys in bytes and speed.

For every configuration (none, int8 and fp8 KV caches, int8 weights, int4 in groups of 128/64/32, the same
int4 with activation-aware scales ("awq", `minfer.quant.awq`), and combinations) one process
measures, on the same machine and dtype:
  - perplexity on the fixed evaluation set and its change against "none" (`minfer.lab.evaluate`),
  - greedy agreement with the unquantized model (teacher-forced, `minfer.lab.evaluate`),
  - bytes of the decoder layers' linear weights (scales and zero points included) and the
    ratio to bfloat16, and KV-cache bytes per token,
  - decode tokens/s at batch 1 and at a larger batch (`minfer.lab.bench.decode_speed.time_minfer`).

The honest int4 rows. SmolLM2-135M ships as GGUF Q4_1: its weights already sit on a 4-bit grid,
in blocks of 32 along each row. int4 with groups of 32 aligned to those blocks can land on the
same grid and look nearly free. To see what int4 costs on weights that were never quantized,
the same model is also measured "scrambled": the hidden channels, the MLP's inner channels and
each value head's channels are permuted consistently, which leaves every output unchanged
(the scrambled "none" row shows it) but scatters every Q4_1 block over many groups.

llama.cpp, the CPU peer, is measured on the same GGUF file at batch 1 when `llama_cpp`
(llama-cpp-python) is installed; it is never required.
"""
from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from minfer.lab.bench.common import machine_info
from minfer.lab.bench.decode_speed import make_prompts, time_minfer
from minfer.lab.bench.timing import best_of
from minfer.lab.evaluate import EVAL_PROMPTS, eval_set_info, greedy_agreement, greedy_reference, perplexity
from minfer.llm import LLM
from minfer.quant import linear_weight_bytes
from minfer.lab.qat import default_checkpoint_dir

DOCS_START = "<!-- bench_quant:start -->"
DOCS_END = "<!-- bench_quant:end -->"

# name -> LLM arguments
CONFIGS = {
    "none": {},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "fp8 KV": {"kv_cache_dtype": "fp8"},  # e4m3, a static scale per (layer, KV head): `minfer.formats.kv`
    "int8 weights": {"quantization": "int8"},
    "int4 g128": {"quantization": "int4", "quantization_group_size": 128},
    "int4 g64": {"quantization": "int4", "quantization_group_size": 64},
    "int4 g32": {"quantization": "int4", "quantization_group_size": 32},
    "awq g64": {"quantization": "awq", "quantization_group_size": 64},  # int4 + activation-aware scales and clipping
    "awq g32": {"quantization": "awq", "quantization_group_size": 32},
    # int4 with GPTQ's codes (after AWQ's scales, in activation order: `minfer.quant.gptq`)
    "gptq g64": {"quantization": "gptq", "quantization_group_size": 64},
    "nf4 b64": {"quantization": "nf4", "quantization_group_size": 64},  # QLoRA's NormalFloat, absmax per 64
    "fp8 weights": {"quantization": "fp8"},  # e4m3 per output channel: `minfer.quant.fp8_linear`
    "gptq fp8": {"quantization": "gptq_fp8"},  # the same e4m3 rows, values chosen by GPTQ: `minfer.quant.gptq`
    # plain int4 g64 of weights fine-tuned with fake quantization (`minfer.lab.qat`): the checkpoint
    # benchmarks/train_qat.py writes, of smollm2-135m only
    "qat g64": {"model": str(default_checkpoint_dir())},
    "int8 weights + int8 KV": {"quantization": "int8", "kv_cache_dtype": "int8"},
    "int4 g64 + int8 KV": {"quantization": "int4", "quantization_group_size": 64, "kv_cache_dtype": "int8"},
}
HONEST = ("none", "int8 weights", "fp8 weights", "gptq fp8", "int4 g64", "awq g64", "gptq g64", "int4 g32", "awq g32")  # measured again on the scrambled model

# the benchmark's targets: perplexity increase at most, bytes ratio to bfloat16 at least, speed vs llama.cpp
TARGETS = {"ppl": {"int8 weights": 0.01, "fp8 weights": 0.01, "gptq fp8": 0.01, "int4 g64": 0.05, "awq g64": 0.05, "gptq g64": 0.05, "int8 KV": 0.005,
                   "fp8 KV": 0.01},
           "scrambled_ppl": {"gptq g64": 0.08},
           "recovered": {"qat g64": ("int4 g64", 0.5)},
           "bytes": {"int8 weights": 1.9, "int4 g64": 3.5, "gptq g64": 3.5}, "llama_cpp": 0.75}

PRESETS = {
    "quick": dict(num_tokens=512, window=256, stride=128, prompts=4, agreement_tokens=8, max_tokens=8,
                  prompt_len=16, batch_size=4, repeats=1),
    "full": dict(num_tokens=4096, window=512, stride=256, prompts=len(EVAL_PROMPTS), agreement_tokens=32,
                 max_tokens=48, prompt_len=64, batch_size=16, repeats=3),
}


# --------------------------------------------------------------------------- the scrambled model

def scramble_weights(weights: dict[str, torch.Tensor], config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Permute channels so that every output stays the same but no quantization block survives.

    Hidden channels (the residual stream: embedding columns, norms, the input columns of q/k/v
    and gate/up, the output rows of o_proj and down_proj), the MLP's inner channels (gate/up
    rows, down columns) and each value head's channels (v rows, o_proj columns of the query
    heads that read it). RMSNorm, SwiGLU and attention do not care about channel order, and
    the q/k rows (where RoPE pairs channels) are left alone.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randperm(config.hidden_size, generator=gen)
    inner = torch.randperm(config.intermediate_size, generator=gen)
    hd, group = config.head_dim, config.num_heads // config.num_kv_heads
    per_head = [torch.randperm(hd, generator=gen) for _ in range(config.num_kv_heads)]
    v_rows = torch.cat([h * hd + p for h, p in enumerate(per_head)])
    o_cols = torch.cat([q * hd + per_head[q // group] for q in range(config.num_heads)])
    out = {}
    for name, w in weights.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            w = w[:, hidden]
        elif name.endswith("norm.weight"):
            w = w[hidden]
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            w = w[:, hidden]
        elif name.endswith("v_proj.weight"):
            w = w[v_rows][:, hidden]
        elif name.endswith("v_proj.bias"):
            w = w[v_rows]
        elif name.endswith("o_proj.weight"):
            w = w[hidden][:, o_cols]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            w = w[inner][:, hidden]
        elif name.endswith("down_proj.weight"):
            w = w[hidden][:, inner]
        elif not name.endswith(("q_proj.bias", "k_proj.bias")):
            raise ValueError(f"scramble_weights does not know where {name!r} belongs")
        out[name] = w.contiguous()
    return out


def scrambled_checkpoint(model: str, folder: str, seed: int = 0) -> str:
    """`model` with scrambled channels (see scramble_weights), saved as a Hugging Face directory."""
    from minfer.models.loader import LoadedModel, load_model, save_hf_checkpoint

    loaded = load_model(model, torch.float32)
    weights = scramble_weights(loaded.weights, loaded.config, seed)
    save_hf_checkpoint(LoadedModel(loaded.config, weights, loaded.tokenizer, folder, eos_token_ids=loaded.eos_token_ids),
                       folder)
    return folder


# --------------------------------------------------------------------------- llama.cpp (optional)

def time_llama_cpp(gguf_path: str, prompt_ids: list[int], max_tokens: int, threads: int, repeats: int) -> dict:
    """Batch-1 greedy decode tokens/s of llama-cpp-python on the GGUF file (best of repeats)."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf_path, n_ctx=len(prompt_ids) + max_tokens + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)  # (n_threads_batch: the prompt's threads)
    best = float("inf")
    for _ in range(repeats):
        llm.reset()
        times = []
        for _token in llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == max_tokens:
                break
        best = min(best, (times[-1] - times[0]) / (len(times) - 1))
    del llm
    return {"engine": f"llama.cpp ({threads} thread{'s' if threads > 1 else ''})", "threads": threads,
            "tpot_s": best, "decode_tokens_per_s": 1 / best}


# --------------------------------------------------------------------------- the run

KV_CACHE_BYTES = 2**29  # enough for every perplexity window at once


def _make_llm(model: str, dtype: str, device: str, arguments: dict) -> LLM:
    return LLM(model, dtype=dtype, device=device, seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES, **arguments)


def measure_quality(llm: LLM, reference, preset: dict) -> dict:
    ppl = perplexity(llm, preset["num_tokens"], preset["window"], preset["stride"])
    return {"perplexity": ppl, "greedy_agreement": greedy_agreement(llm, reference)}


def measure_speed(llm: LLM, preset: dict) -> dict:
    prompts = make_prompts(llm.config.vocab_size, preset["batch_size"], preset["prompt_len"])
    out = {}
    for key, batch in (("batch1", 1), ("batched", preset["batch_size"])):
        timing = best_of([time_minfer(llm, prompts, preset["max_tokens"], batch) for _ in range(preset["repeats"])])
        out[f"{key}_tokens_per_s"] = timing.decode_tokens_per_s
    return out


def run_quant_benchmark(model: str = "smollm2-135m", dtype: str = "bfloat16", device: str = "cpu",
                        configs: Sequence[str] = tuple(CONFIGS), quick: bool = False, honest: bool = True,
                        speed: bool = True, llama_cpp_threads: Sequence[int] = (1, 2), log=print, **overrides) -> dict:
    """Measure every configuration in turn (one model in memory at a time). Returns a JSON-able dict."""
    preset = {**PRESETS["quick" if quick else "full"], **{k: v for k, v in overrides.items() if v is not None}}
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "none" not in configs:
        raise ValueError(f"configs must include 'none' and come from {list(CONFIGS)}, got {list(configs)}")
    prompts = EVAL_PROMPTS[:preset["prompts"]]
    result = {"model": model, "dtype": dtype, "device": device, "preset": preset, "machine": machine_info(device),
              "rows": [], "honest_rows": [], "skipped": {}, "llama_cpp": []}
    baseline = _make_llm(model, dtype, device, {})
    result["eval_set"] = eval_set_info(baseline.tokenizer, preset["num_tokens"], preset["window"], preset["stride"])
    reference = greedy_reference(baseline, prompts, preset["agreement_tokens"])
    bf16_bytes, vocab_size = linear_weight_bytes(baseline.model, torch.bfloat16), baseline.config.vocab_size
    del baseline
    for name in configs:
        row = _measure(name, model, dtype, device, reference, preset, speed, result["skipped"], log)
        if row is not None:
            row["linear_bytes_ratio_vs_bf16"] = bf16_bytes / row["linear_bytes"]
            result["rows"].append(row)
    if honest:
        with tempfile.TemporaryDirectory() as folder:
            scrambled = scrambled_checkpoint(model, folder)
            base = _make_llm(scrambled, dtype, device, {})
            scrambled_reference = greedy_reference(base, prompts, preset["agreement_tokens"])
            del base
            for name in (c for c in HONEST if c in configs):
                row = _measure(name, scrambled, dtype, device, scrambled_reference, preset, False,
                               result["skipped"], log, label="scrambled")
                if row is not None:
                    result["honest_rows"].append(row)
    for rows in (result["rows"], result["honest_rows"]):
        none = next((r for r in rows if r["config"] == "none"), None)
        for r in rows:
            r["ppl_change"] = r["perplexity"] / none["perplexity"] - 1 if none else None
    if speed and llama_cpp_threads:
        result["llama_cpp"] = _llama_cpp_rows(model, vocab_size, preset, llama_cpp_threads, result["skipped"], log)
    result["targets"] = check_targets(result)
    return result


def _measure(name: str, model: str, dtype: str, device: str, reference, preset: dict, speed: bool, skipped: dict,
             log, label: str = "") -> Optional[dict]:
    key = f"{name} ({label})" if label else name
    arguments = dict(CONFIGS[name])
    checkpoint = arguments.pop("model", None)  # a row that is a saved checkpoint of the model (qat g64)
    try:
        if checkpoint is not None:
            if model != "smollm2-135m" or not Path(checkpoint, "config.json").exists():
                raise ValueError(f"needs {checkpoint}, which `python benchmarks/train_qat.py` writes "
                                 f"(fine-tuned from smollm2-135m only)")
            model = checkpoint
        llm = _make_llm(model, dtype, device, arguments)
    except ValueError as exc:  # e.g. a group size that does not divide this model's sizes
        skipped[key] = str(exc)
        log(f"skipped {key}: {exc}")
        return None
    start = time.perf_counter()
    row = {"config": name, **measure_quality(llm, reference, preset), "linear_bytes": linear_weight_bytes(llm.model),
           "kv_bytes_per_token": llm.config.kv_bytes_per_token(llm.dtype, llm.engine.config.kv_cache_dtype)}
    if speed:
        row.update(measure_speed(llm, preset))
    log(f"{key}: perplexity {row['perplexity']:.3f}, agreement {row['greedy_agreement']:.3f} "
        f"({time.perf_counter() - start:.0f} s)")
    del llm
    gc.collect()
    return row


def _llama_cpp_rows(model: str, vocab_size: int, preset: dict, threads: Sequence[int], skipped: dict,
                    log) -> list[dict]:
    from minfer.models.loader import resolve_model_path

    path = resolve_model_path(model)
    try:
        import llama_cpp  # noqa: F401  (optional: pip install llama-cpp-python)
    except ImportError:
        skipped["llama.cpp"] = "llama_cpp is not installed (pip install llama-cpp-python; optional)"
        log("skipped llama.cpp: not installed")
        return []
    if not path.endswith(".gguf"):
        skipped["llama.cpp"] = f"{path} is not a GGUF file"
        return []
    prompt = make_prompts(vocab_size, 1, preset["prompt_len"])[0]  # the same kind of prompt minfer gets
    rows = [time_llama_cpp(path, prompt, preset["max_tokens"], t, preset["repeats"]) for t in threads]
    for r in rows:
        log(f"{r['engine']}: {r['decode_tokens_per_s']:.1f} tokens/s at batch 1")
    return rows


def merge_results(saved: dict, new: dict) -> dict:
    """`saved` with the rows of `new` (a run of only some configurations) in place of its own, in CONFIGS order.

    Both must be measured the same way (same model, dtype, device and preset). Every run measures
    "none" again, and each new row's change is against its own run's "none"; the saved "none" rows
    stay, since the saved rows (and their speeds) were measured against them.
    """
    same = ("model", "dtype", "device", "preset", "eval_set")
    differ = [key for key in same if saved.get(key) != new.get(key)]
    if differ:
        raise ValueError(f"cannot merge runs measured differently: {differ} differ")
    merged = {**saved, "skipped": {**saved["skipped"], **new["skipped"]}, "command": saved.get("command")}
    merged["merged_commands"] = saved.get("merged_commands", []) + [new.get("command")]
    for key in ("rows", "honest_rows"):
        rows = {r["config"]: r for r in saved[key]}
        rows.update({r["config"]: r for r in new[key] if r["config"] != "none" or "none" not in rows})
        merged[key] = [rows[name] for name in CONFIGS if name in rows]
    merged["targets"] = check_targets(merged)
    return merged


def check_targets(result: dict) -> list[dict]:
    """The benchmark's targets (TARGETS), each with the measured value and pass / miss (None: not measured)."""
    rows = {r["config"]: r for r in result["rows"]}
    checks = []
    for name, limit in TARGETS["ppl"].items():
        value = rows[name]["ppl_change"] if name in rows else None
        checks.append({"target": f"{name}: perplexity increase ≤ {limit:.1%}", "value": value,
                       "format": "pct", "passed": None if value is None else value <= limit})
    scrambled = {r["config"]: r for r in result.get("honest_rows", [])}
    for name, limit in TARGETS["scrambled_ppl"].items():
        value = scrambled[name]["ppl_change"] if name in scrambled else None
        checks.append({"target": f"{name}: perplexity increase ≤ {limit:.1%} on the scrambled model", "value": value,
                       "format": "pct", "passed": None if value is None else value <= limit})
    for name, (base, limit) in TARGETS["recovered"].items():  # the share of base's increase that name removes
        value = None  # from each row's change against its own run's "none" (rows merged from several runs)
        if {name, base} <= set(rows) and rows[base]["ppl_change"] > 0:
            value = (rows[base]["ppl_change"] - rows[name]["ppl_change"]) / rows[base]["ppl_change"]
        checks.append({"target": f"{name}: recovers ≥ {limit:.0%} of {base}'s perplexity increase", "value": value,
                       "format": "share_pct", "passed": None if value is None else value >= limit})
    for name, limit in TARGETS["bytes"].items():
        value = rows[name]["linear_bytes_ratio_vs_bf16"] if name in rows else None
        checks.append({"target": f"{name}: linear weight bytes ≥ {limit}× smaller than bfloat16", "value": value,
                       "format": "x", "passed": None if value is None else value >= limit})
    threads = result["machine"]["torch_threads"]
    peer = next((r for r in result["llama_cpp"] if r["threads"] == threads), None)
    int4 = rows.get("int4 g64", {}).get("batch1_tokens_per_s")
    value = int4 / peer["decode_tokens_per_s"] if peer and int4 else None
    checks.append({"target": f"int4 g64 batch-1 decode ≥ {TARGETS['llama_cpp']}× llama.cpp ({threads} thread(s))",
                   "value": value, "format": "x", "passed": None if value is None else value >= TARGETS["llama_cpp"]})
    return checks


# --------------------------------------------------------------------------- the report

def _fmt(value, kind: str) -> str:
    if value is None:
        return "–"
    return {"pct": f"{value:+.2%}", "share_pct": f"{value:.1%}", "x": f"{value:.2f}×", "ppl": f"{value:.3f}", "share": f"{value:.3f}",
            "mb": f"{value / 1e6:.1f}", "tps": f"{value:.1f}", "b": f"{value:.0f}"}[kind]


def format_markdown(result: dict, command: Optional[str] = None) -> str:
    p, m = result["preset"], result["machine"]
    lines = [f"{result['model']}, {result['dtype']} on {result['device']} ({m['cpu']}, {m['torch_threads']} torch "
             f"thread(s), load average {m.get('load_average_1min', '?')}). Perplexity: {p['num_tokens']} tokens of "
             f"pydoc_data.topics (Python {result['eval_set']['python']}), windows of {p['window']} every {p['stride']}. "
             f"Greedy agreement: {p['prompts']} prompts × {p['agreement_tokens']} tokens, teacher-forced. Speed: "
             f"greedy decode of {p['max_tokens']} tokens after a {p['prompt_len']}-token prompt, best of {p['repeats']}.",
             "", "| config | perplexity | Δ ppl | greedy agreement | linear weights (MB) | vs bf16 | KV bytes/token "
             f"| batch 1 tok/s | batch {p['batch_size']} tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['config']} | {_fmt(r['perplexity'], 'ppl')} | {_fmt(r['ppl_change'], 'pct')} | "
                     f"{_fmt(r['greedy_agreement'], 'share')} | {_fmt(r['linear_bytes'], 'mb')} | "
                     f"{_fmt(r['linear_bytes_ratio_vs_bf16'], 'x')} | {_fmt(r['kv_bytes_per_token'], 'b')} | "
                     f"{_fmt(r.get('batch1_tokens_per_s'), 'tps')} | {_fmt(r.get('batched_tokens_per_s'), 'tps')} |")
    for r in result["llama_cpp"]:
        lines.append(f"| {r['engine']}, same GGUF | | | | | | | {_fmt(r['decode_tokens_per_s'], 'tps')} | |")
    if result["honest_rows"]:
        lines += ["", "Scrambled model (channels permuted: same outputs, no Q4_1 block left intact), the honest int4 "
                  "figure:", "", "| config | perplexity | Δ ppl | greedy agreement |", "|---|---|---|---|"]
        for r in result["honest_rows"]:
            lines.append(f"| {r['config']} | {_fmt(r['perplexity'], 'ppl')} | {_fmt(r['ppl_change'], 'pct')} | "
                         f"{_fmt(r['greedy_agreement'], 'share')} |")
    lines += ["", "Targets:", ""]
    for t in result["targets"]:
        verdict = {True: "pass", False: "**miss**", None: "not measured"}[t["passed"]]
        lines.append(f"- {t['target']}: {_fmt(t['value'], t['format'])} — {verdict}")
    if result["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in result["skipped"].items())]
    if command:
        lines += ["", f"Command: `{command}`"]
    for extra in result.get("merged_commands", []):
        lines += [f"Rows added by: `{extra}` (with \"none\" measured again: their Δ is against that run's own)"]
    return "\n".join(lines) + "\n"


def plot_tradeoff(result: dict, figure=None):
    """Perplexity increase against the decoder layers' weight bytes, one point per format (a Figure, no pyplot).

    KV-cache rows sit at their weight format's bytes: they trade KV bytes per token, not weight bytes."""
    from matplotlib.figure import Figure

    figure = figure or Figure(figsize=(7.5, 4.5))
    ax = figure.subplots()
    for i, r in enumerate(r for r in result["rows"] if " + " not in r["config"]):  # combinations: in the table
        kv = r["kv_bytes_per_token"] < next(x["kv_bytes_per_token"] for x in result["rows"] if x["config"] == "none")
        ax.scatter(r["linear_bytes"] / 1e6, 100 * r["ppl_change"], marker="^" if kv else "o",
                   color="tab:orange" if kv else "tab:blue")
        ax.annotate(r["config"], (r["linear_bytes"] / 1e6, 100 * r["ppl_change"]), fontsize=8,
                    xytext=(5, -10 + 9 * (i % 3)), textcoords="offset points")  # staggered: close points
    ax.set_xlabel("decoder weight bytes (MB; bfloat16 = the 'none' row)")
    ax.set_ylabel("perplexity increase (%)")
    ax.set_title(f"{result['model']}: bytes vs quality (triangles: a quantized KV cache)")
    ax.axhline(0, color="gray", lw=0.5)
    ax.grid(alpha=0.3)
    return figure
