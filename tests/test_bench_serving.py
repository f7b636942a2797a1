"""The serving benchmark's helpers (minfer/lab/bench/serving*.py) on a tiny random model: fast, no timing asserts."""
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest

from minfer import LLM
from minfer.lab.bench import (serving, serving_engines, serving_prefix, serving_report, serving_stats,
                               serving_workload)

REPO = Path(__file__).resolve().parent.parent
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny_dir's K and V: 2 layers x 2 KV heads x head_dim 16, float32


@pytest.fixture(scope="module")
def tiny_llm(make_tiny_llm) -> LLM:
    return make_tiny_llm(max_num_seqs=4, kv_cache_memory_bytes=2**22)


def test_workload_is_deterministic_and_within_bounds(llm):
    a = serving_workload.make_workload(llm.tokenizer, 20, (5, 40), (3, 30), seed=7)
    b = serving_workload.make_workload(llm.tokenizer, 20, (5, 40), (3, 30), seed=7)
    c = serving_workload.make_workload(llm.tokenizer, 20, (5, 40), (3, 30), seed=8)
    assert [(r.prompt_token_ids, r.max_tokens) for r in a] == [(r.prompt_token_ids, r.max_tokens) for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    assert len(a) == 20
    assert all(5 <= len(r.prompt_token_ids) <= 40 and 3 <= r.max_tokens <= 30 for r in a)
    assert len({len(r.prompt_token_ids) for r in a}) > 5 and len({r.max_tokens for r in a}) > 5  # varied
    text = llm.tokenizer.decode(a[0].prompt_token_ids)
    assert any(c.isalpha() for c in text)  # real text, from the Python docs
    with pytest.raises(ValueError):
        serving_workload.make_workload(llm.tokenizer, 4, (10, 5), (1, 2))


def test_text_tokens_gives_exactly_n():
    class CharTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(ch) for ch in text]

    for n in (1, 17, 300):
        assert len(serving_workload.text_tokens(CharTokenizer(), n, random.Random(0))) == n


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 5, 101):
        values = [rng.random() for _ in range(n)]
        for q in (0, 25, 50, 90, 99, 100):
            assert serving_stats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert serving_stats.percentile([], 50) != serving_stats.percentile([], 50)  # nan


def test_latency_stats_and_summarize():
    stats = serving_stats.latency_stats([1.0, None, 3.0, 2.0])
    assert stats["mean"] == pytest.approx(2.0) and stats["p50"] == pytest.approx(2.0)
    assert stats["p99"] == pytest.approx(2.98)
    rows = [{"ttft": 0.1, "tpot": 0.01, "num_output_tokens": 10}, {"ttft": 0.3, "tpot": None, "num_output_tokens": 1}]
    s = serving_stats.summarize("x", rows, 2.0, note="n")
    assert s["output_tokens"] == 11 and s["output_tokens_per_s"] == pytest.approx(5.5)
    assert s["requests_per_s"] == pytest.approx(1.0) and s["tpot"]["mean"] == pytest.approx(0.01)
    assert s["ttft"]["p50"] == pytest.approx(0.2) and s["note"] == "n"


def test_kv_waste_against_hand_computed_numbers():
    prompts, outputs = [10, 20, 5], [5, 30, 1]  # lengths 15, 50, 6
    full, static, paged = serving_workload.kv_waste(prompts, outputs, bytes_per_token=2, block_size=16,
                                                    batch_size=2, max_model_len=100)
    rows = {"contiguous ma": full, "contiguous st": static, "paged bl": paged}
    assert "max_model_len" in full["scheme"] and "static" in static["scheme"] and "paged" in paged["scheme"]
    used = (15 + 50 + 6) * 2
    assert all(r["used_bytes"] == used for r in rows.values())
    assert rows["contiguous ma"]["reserved_bytes"] == 3 * 100 * 2
    # batch 1: two rows of (20 + 30); batch 2: one row of (5 + 1)
    assert rows["contiguous st"]["reserved_bytes"] == (2 * 50 + 6) * 2
    # 15 -> 1 block, 50 -> 4 blocks, 6 -> 1 block, of 16 tokens
    assert rows["paged bl"]["reserved_bytes"] == 6 * 16 * 2
    assert rows["paged bl"]["waste"] == pytest.approx(1 - 71 / 96)


@pytest.mark.slow
def test_run_minfer_counts_and_kv(tiny_llm):
    work = serving_workload.make_workload(tiny_llm.tokenizer, 6, (4, 40), (2, 20), seed=3)
    cont = serving_engines.run_minfer(tiny_llm, work, "continuous", max_num_seqs=4)
    static = serving_engines.run_minfer(tiny_llm, work, "static", max_num_seqs=4)
    total = sum(r.max_tokens for r in work)
    assert cont["output_tokens"] == static["output_tokens"] == total and cont["requests"] == 6
    bpt = BYTES_PER_TOKEN
    batches = work[:4], work[4:]
    slots = [len(b) * (max(len(r.prompt_token_ids) for r in b) + max(r.max_tokens for r in b)) for b in batches]
    peak = slots.index(max(slots))  # static: the largest batch's contiguous cache, and the tokens it holds at its end
    assert static["kv_reserved_bytes"] == slots[peak] * bpt
    assert static["kv_used_bytes"] == sum(len(r.prompt_token_ids) + r.max_tokens for r in batches[peak]) * bpt
    # paged: at least the largest request's blocks, at most the blocks of the 4 largest (4 run at once)
    blocks = sorted(-(-(len(r.prompt_token_ids) + r.max_tokens) // 16) for r in work)
    assert blocks[-1] * 16 * bpt <= cont["kv_used_bytes"] <= sum(blocks[-4:]) * 16 * bpt
    assert cont["kv_reserved_bytes"] == tiny_llm.engine.runner.pool.nbytes == 2**22 // (16 * bpt) * 16 * bpt
    seq = serving_engines.run_sequential(tiny_llm, work[:2])
    assert seq["output_tokens"] == work[0].max_tokens + work[1].max_tokens


@pytest.mark.slow
def test_prefix_cases(tiny_llm):
    prompts = serving_prefix.prefix_scenarios(tiny_llm.tokenizer, num_requests=3, system_tokens=48, passage_tokens=16,
                                              num_passages=3)
    assert all(p[:48] == prompts["shared first"][0][:48] for p in prompts["shared first"])
    assert all(p[-48:] == prompts["shared after"][0][-48:] for p in prompts["shared after"])
    assert sorted(map(len, prompts["passages, shuffled"])) == sorted(map(len, prompts["passages, stable order"]))
    # one request at a time, so each later one can find the first one's blocks
    off = serving_prefix.run_prefix_case(tiny_llm, prompts["shared first"][:1] * 1, 2, False, "off", max_num_seqs=1)
    assert off["prefill_tokens_computed"] == off["prompt_tokens"] and off["hit_rate"] == 0
    on = serving_prefix.run_prefix_case(tiny_llm, prompts["shared first"], 2, True, "on", max_num_seqs=1)
    assert on["hit_rate"] == pytest.approx(2 * 48 / on["prompt_tokens"])
    assert on["prefill_tokens_computed"] == on["prompt_tokens"] - 2 * 48
    after = serving_prefix.run_prefix_case(tiny_llm, prompts["shared after"], 2, True, "after", max_num_seqs=1)
    assert after["hit_rate"] == 0 and after["prefill_tokens_computed"] == after["prompt_tokens"]


@pytest.mark.slow
def test_prefix_experiment_times_warm_cases_and_reports_the_cold_request_apart(tiny_llm):
    result = serving_prefix.run_prefix_experiment(tiny_llm, num_requests=2, system_tokens=32, max_tokens=2,
                                                  passage_tokens=8, num_passages=2, max_num_seqs=2)
    assert [r["case"] for r in result["rows"]][:2] == ["shared first, no prefix caching", "shared first, prefix caching"]
    assert result["cold"]["requests"] == 1 and result["cold"]["prefix_caching"] is False
    stored = json.loads((Path(__file__).resolve().parents[1] / "docs" / "serving.json").read_text())
    assert "cold and alone" in serving_report.format_markdown({**stored, "prefix": result})


def test_update_docs_section_keeps_other_sections(tmp_path):
    page = tmp_path / "b.md"
    page.write_text("# Benchmarks\n\n<!-- bench_generate:start -->\nold gen\n<!-- bench_generate:end -->\n")
    serving_report.update_docs_section("table one", page, intro="why")
    serving_report.update_docs_section("table two", page)
    text = page.read_text()
    assert "old gen" in text and "table two" in text and "table one" not in text
    assert text.count(serving_report.DOCS_START) == 1 and text.count("why") == 1


@pytest.mark.slow
def test_quick_cli_end_to_end(tiny_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_serving", REPO / "benchmarks" / "bench_serving.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nkeep me\n")
    out_json, png = tmp_path / "r.json", tmp_path / "serving.png"
    assert bench.main(["--quick", "--model", tiny_dir, "--dtype", "float32", "--threads", "1", "--no-progress",
                       "--kv-cache-memory-bytes", str(2**22), "--json", str(out_json), "--plot", str(png),
                       "--update-docs", str(page)]) == 0
    result = json.loads(out_json.read_text())
    engines = [r["engine"] for r in result["rows"]]
    assert engines == ["minfer continuous", "minfer static", "minfer continuous (subset)", "minfer one by one",
                       "transformers generate (padded batches)"]
    quick = serving.PRESETS["quick"]
    assert result["rows"][0]["requests"] == quick["num_requests"] and result["rows"][3]["requests"] == quick["subset"]
    assert result["rows"][0]["output_tokens"] == result["rows"][1]["output_tokens"] == \
        result["settings"]["workload_output_tokens"]
    assert result["rows"][3]["output_tokens"] == result["rows"][4]["output_tokens"]  # the same subset
    assert set(result["ratios"]) == {"continuous_vs_static", "continuous_vs_sequential", "subset_continuous_vs_sequential",
                                     "continuous_vs_transformers", "subset_continuous_vs_transformers"}
    assert result["kv_bytes_per_token"] == BYTES_PER_TOKEN
    assert len(result["prefix"]["rows"]) == 5 and result["prefix"]["rows"][2]["hit_rate"] == 0  # shared text last
    assert [w["waste"] for w in result["kv_waste"]] == sorted((w["waste"] for w in result["kv_waste"]), reverse=True)
    text = page.read_text()
    assert "keep me" in text and serving_report.DOCS_START in text and "minfer one by one" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
