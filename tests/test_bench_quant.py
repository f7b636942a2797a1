"""The quantization benchmark on a tiny random model: every row runs, the scramble keeps outputs, docs get written."""
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from minfer import LLM
from minfer.lab.bench import quant as qb
from minfer.lab.bench.timing import Timing
from minfer.models.loader import load_model

# tiny_dir by hand: 2 layers of q/k/v (128 x 64), o (64 x 64), gate/up (256 x 64), down (64 x 128): the
# decoder's linear weights, and their output rows (one int8 scale each)
LINEAR_PARAMS, LINEAR_ROWS = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128), 2 * (128 + 64 + 256 + 64)
VOCAB = 49152  # SmolLM2's tokenizer
SMALL = dict(num_tokens=120, window=64, stride=32, prompts=2, agreement_tokens=4, max_tokens=4, prompt_len=8,
             batch_size=2, repeats=1)


@pytest.mark.parametrize("model_type,tie", [("llama", True), ("qwen2", False)])
def test_scrambled_model_gives_the_same_logits(tmp_path, tiny_checkpoint, model_type, tie):
    plain_dir = tiny_checkpoint(model_type, tie)
    qb.scrambled_checkpoint(plain_dir, str(tmp_path / "scrambled"))
    plain, scrambled = (LLM(folder, dtype="float32", device="cpu", num_gpu_blocks_override=8)
                        for folder in (plain_dir, str(tmp_path / "scrambled")))
    ids = torch.tensor([[1, 400, 2000, 31, 9000, 77, 5, 123]])
    positions = torch.arange(ids.shape[1])[None]
    ours = scrambled.model(ids, positions, last_only=False)
    assert (ours - plain.model(ids, positions, last_only=False)).abs().max().item() <= 1e-4
    before = load_model(plain_dir).weights
    after = load_model(str(tmp_path / "scrambled")).weights
    name = "model.layers.0.mlp.gate_proj.weight"
    assert not torch.equal(before[name], after[name])  # the weights did move


@pytest.mark.slow
def test_quick_run_on_a_tiny_model(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(qb, "KV_CACHE_BYTES", 2**23)
    logs = []
    result = qb.run_quant_benchmark(tiny_dir, "float32", "cpu", quick=True, llama_cpp_threads=(), log=logs.append,
                                    **SMALL)
    rows = {r["config"]: r for r in result["rows"]}
    assert rows["none"]["ppl_change"] == 0.0 and rows["none"]["greedy_agreement"] == 1.0
    # every configuration is measured, but int4 in groups of 128, which do not divide the hidden size 64
    assert list(result["skipped"]) == ["int4 g128", "qat g64"] and "hidden_size 64" in result["skipped"]["int4 g128"]
    assert "train_qat.py" in result["skipped"]["qat g64"]  # a checkpoint of smollm2-135m only
    assert list(rows) == [c for c in qb.CONFIGS if c not in ("int4 g128", "qat g64")]
    for r in rows.values():
        # a random model predicts nearly uniformly: perplexity near the vocabulary size (exactly it if uniform)
        assert VOCAB / 3 < r["perplexity"] < 3 * VOCAB
        assert set(r) >= {"batch1_tokens_per_s", "batched_tokens_per_s"}  # the speed itself: test_measure_speed
    honest = {r["config"]: r for r in result["honest_rows"]}
    assert list(honest) == list(qb.HONEST)
    assert honest["none"]["perplexity"] == pytest.approx(rows["none"]["perplexity"], rel=1e-4)
    # bytes by hand: float32 (4 bytes), int8 + a float32 scale per row, int4 (half a byte) + bfloat16 scale and
    # minimum per group; the ratio is to the same weights in bfloat16
    expected_bytes = {"none": 4 * LINEAR_PARAMS, "int8 weights": LINEAR_PARAMS + 4 * LINEAR_ROWS,
                      "int4 g64": LINEAR_PARAMS // 2 + 4 * LINEAR_PARAMS // 64,
                      "int4 g32": LINEAR_PARAMS // 2 + 4 * LINEAR_PARAMS // 32}
    expected_bytes.update({"int8 KV": expected_bytes["none"], "fp8 KV": expected_bytes["none"], "awq g64": expected_bytes["int4 g64"],
                           "awq g32": expected_bytes["int4 g32"], "int8 weights + int8 KV": expected_bytes["int8 weights"],
                           "int4 g64 + int8 KV": expected_bytes["int4 g64"], "gptq g64": expected_bytes["int4 g64"],
                           "nf4 b64": LINEAR_PARAMS // 2 + 2 * LINEAR_PARAMS // 64,  # a float16 absmax per 64
                           "fp8 weights": LINEAR_PARAMS + 4 * LINEAR_ROWS})  # one byte a weight, a float32 scale a row
    expected_bytes["gptq fp8"] = expected_bytes["fp8 weights"]  # the same format, other values
    assert {name: r["linear_bytes"] for name, r in rows.items()} == expected_bytes
    assert rows["int8 weights"]["linear_bytes_ratio_vs_bf16"] == pytest.approx(2 * LINEAR_PARAMS / expected_bytes["int8 weights"])
    # KV per token: K and V x 2 layers x 2 KV heads x (16 float32 values, 16 int8 values and a float32 scale,
    # or 16 fp8 values: their scales are per layer and head, not per token)
    assert {name: r["kv_bytes_per_token"] for name, r in rows.items()} == {
        name: 2 * 2 * 2 * (16 + 4 if "int8 KV" in name else 16 if "fp8 KV" in name else 16 * 4) for name in rows}
    markdown = qb.format_markdown(result, "cmd")
    assert "| none |" in markdown and "Targets:" in markdown
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps(result))
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nother section\n")
    spec = importlib.util.spec_from_file_location("bench_quant", Path(__file__).parent.parent / "benchmarks" / "bench_quant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for _ in range(2):  # the second run replaces the section instead of adding another
        assert bench.main(["--render", str(saved), "--update-docs", str(page)]) == 0
    text = page.read_text()
    assert text.count(qb.DOCS_START) == 1 and "other section" in text and "| none |" in text


def test_llama_cpp_rows_and_the_speed_target(monkeypatch):
    """The optional llama.cpp measurement, with a stand-in for llama_cpp (the real one is never required)."""
    class FakeLlama:
        def __init__(self, model_path, n_threads, **kwargs):
            assert model_path.endswith(".gguf")
            self.threads = n_threads

        def reset(self):
            pass

        def generate(self, tokens, **kwargs):
            while True:
                yield 1

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    ticks = iter(range(1000))
    monkeypatch.setattr(qb, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 0.01))
    skipped = {}
    rows = qb._llama_cpp_rows("smollm2-135m", 49152, dict(prompt_len=8, max_tokens=5, repeats=2), (1, 2), skipped,
                              lambda message: None)
    assert [r["threads"] for r in rows] == [1, 2] and not skipped
    # 5 tokens a step of 0.01 s apart: 4 gaps of 0.01 s, so 100 tokens/s
    assert [r["decode_tokens_per_s"] for r in rows] == pytest.approx([100.0, 100.0])
    result = {"rows": [{"config": "int4 g64", "ppl_change": 0.01, "linear_bytes_ratio_vs_bf16": 3.6,
                        "batch1_tokens_per_s": rows[0]["decode_tokens_per_s"]}],
              "machine": {"torch_threads": 1}, "llama_cpp": rows}
    checks = {c["target"].split(":")[0]: c for c in qb.check_targets(result)}
    assert checks["int4 g64 batch-1 decode ≥ 0.75× llama.cpp (1 thread(s))"]["value"] == pytest.approx(1.0)
    assert checks["int4 g64"]["passed"] is True
    assert checks["int8 weights"]["passed"] is None  # not measured


def test_measure_speed_is_batch_over_the_fastest_tpot(monkeypatch):
    """measure_speed times batch 1 and the preset's batch with time_minfer, best of the repeats."""
    tpots = iter([0.05, 0.04, 0.06, 0.08, 0.10, 0.09])  # batch 1: 50, 40, 60 ms; batch 4: 80, 100, 90 ms
    calls = []

    def fake_time_minfer(llm, prompts, max_tokens, batch):
        calls.append((len(prompts), max_tokens, batch))
        return Timing("minfer", "float32", batch, 0.1, next(tpots), max_tokens)

    monkeypatch.setattr(qb, "time_minfer", fake_time_minfer)
    llm = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=512))
    speed = qb.measure_speed(llm, dict(batch_size=4, prompt_len=8, max_tokens=6, repeats=3))
    assert calls == [(4, 6, 1)] * 3 + [(4, 6, 4)] * 3
    assert speed == pytest.approx({"batch1_tokens_per_s": 1 / 0.04, "batched_tokens_per_s": 4 / 0.08})


def test_merge_puts_new_rows_in_place_and_checks_the_scrambled_target():
    """A run of a few configurations replaces those rows of a saved full run; the rest stay."""
    def row(name, ppl_change):
        return {"config": name, "perplexity": 10 * (1 + ppl_change), "ppl_change": ppl_change,
                "greedy_agreement": 0.9, "linear_bytes": 100, "linear_bytes_ratio_vs_bf16": 3.56,
                "kv_bytes_per_token": 1}
    same = {"model": "m", "dtype": "bfloat16", "device": "cpu", "preset": qb.PRESETS["quick"],
            "eval_set": {"python": "3.11"}, "machine": {"cpu": "x", "torch_threads": 1}, "llama_cpp": [], "skipped": {}}
    saved = {**same, "rows": [row("none", 0.0), row("int4 g64", 0.3), row("gptq g64", 0.2)],
             "honest_rows": [row("none", 0.0)], "command": "full"}
    new = {**same, "rows": [row("none", 0.0), row("gptq g64", 0.04)],
           "honest_rows": [row("none", 0.0), row("gptq g64", 0.09)], "command": "some rows"}
    merged = qb.merge_results(saved, new)
    assert [r["config"] for r in merged["rows"]] == ["none", "int4 g64", "gptq g64"]
    assert merged["rows"][2]["ppl_change"] == 0.04 and merged["merged_commands"] == ["some rows"]
    assert merged["rows"][0] is saved["rows"][0]  # the saved rows' baseline stays
    checks = {c["target"]: c["passed"] for c in merged["targets"]}
    assert checks["gptq g64: perplexity increase ≤ 5.0%"] is True
    assert checks["gptq g64: perplexity increase ≤ 8.0% on the scrambled model"] is False
    assert "Rows added by: `some rows`" in qb.format_markdown(merged, "full")
    with pytest.raises(ValueError, match="preset"):
        qb.merge_results(saved, {**new, "preset": qb.PRESETS["full"]})
