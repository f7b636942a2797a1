"""The quantization benchmark on a tiny random model: every row runs, the scramble keeps outputs, docs get written."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from minfer import LLM
from minfer.bench import quant as qb
from minfer.models.loader import load_model

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


def test_quick_run_on_a_tiny_model(tiny_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(qb, "KV_CACHE_BYTES", 2**23)
    logs = []
    result = qb.run_quant_benchmark(tiny_dir, "float32", "cpu", quick=True, llama_cpp_threads=(), log=logs.append,
                                    **SMALL)
    rows = {r["config"]: r for r in result["rows"]}
    assert rows["none"]["ppl_change"] == 0.0 and rows["none"]["greedy_agreement"] == 1.0
    assert set(rows) | {k.split(" (")[0] for k in result["skipped"]} >= set(qb.CONFIGS)  # measured or said why
    for r in rows.values():
        assert r["perplexity"] > 1 and 0 <= r["greedy_agreement"] <= 1
        assert r["batch1_tokens_per_s"] > 0 and r["batched_tokens_per_s"] > 0
    honest = {r["config"]: r for r in result["honest_rows"]}
    assert honest["none"]["perplexity"] == pytest.approx(rows["none"]["perplexity"], rel=1e-4)
    if "int8 weights" in rows:
        assert rows["int8 weights"]["linear_bytes_ratio_vs_bf16"] > 1.7  # rows of 64: scales weigh more than at 576
    if "int8 KV" in rows:
        assert rows["int8 KV"]["kv_bytes_per_token"] < rows["none"]["kv_bytes_per_token"] / 2  # float32 -> int8
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
    import sys
    import types

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
    skipped = {}
    rows = qb._llama_cpp_rows("smollm2-135m", 49152, dict(prompt_len=8, max_tokens=5, repeats=2), (1, 2), skipped,
                              lambda message: None)
    assert [r["threads"] for r in rows] == [1, 2] and not skipped
    assert all(r["decode_tokens_per_s"] > 0 for r in rows)
    result = {"rows": [{"config": "int4 g64", "ppl_change": 0.01, "linear_bytes_ratio_vs_bf16": 3.6,
                        "batch1_tokens_per_s": rows[0]["decode_tokens_per_s"]}],
              "machine": {"torch_threads": 1}, "llama_cpp": rows}
    checks = {c["target"].split(":")[0]: c for c in qb.check_targets(result)}
    assert checks["int4 g64 batch-1 decode ≥ 0.75× llama.cpp (1 thread(s))"]["value"] == pytest.approx(1.0)
    assert checks["int4 g64"]["passed"] is True
    assert checks["int8 weights"]["passed"] is None  # not measured
