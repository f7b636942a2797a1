"""The timing helpers of minfer.bench.generate and minfer.bench.common, on a tiny random model (fast), and the CLI.

No absolute timing is asserted (the machine is shared); only counts, consistency, and ratios
with wide headroom.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minfer import LLM
from minfer.__main__ import main
from minfer.bench import common
from minfer.bench import generate as bm
from minfer.testing import MODEL_SHAPES, random_checkpoint

REPO = Path(__file__).resolve().parent.parent
TINY = MODEL_SHAPES["tiny"]


@pytest.fixture(scope="module")
def tiny_llm(random_tiny_dir) -> LLM:
    return LLM(random_tiny_dir, dtype="float32", device="cpu")


def test_memory_bandwidth_is_positive_and_finite():
    bw = bm.measure_memory_bandwidth(size_mb=16, repeats=2)
    assert 0 < bw < float("inf")


def test_weight_bytes_counts_every_matrix_once(tiny_llm):
    c = TINY
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    expected_params = c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size  # tied head once
    assert bm.weight_bytes(tiny_llm.model) == 4 * expected_params
    bf16 = LLM(tiny_llm.model_path, dtype="bfloat16", device="cpu")
    assert bm.weight_bytes(bf16.model) * 2 == bm.weight_bytes(tiny_llm.model)


def test_weight_bytes_skips_an_untied_embedding(tmp_path):
    from dataclasses import replace

    untied = random_checkpoint(str(tmp_path), replace(TINY, tie_word_embeddings=False))
    model = LLM(untied, dtype="float32", device="cpu").model
    all_params = sum(p.numel() * p.element_size() for p in model.parameters())
    # the head is read in full each step, the embedding only one row per token
    assert bm.weight_bytes(model) == all_params - model.embed_tokens.weight.nbytes


def test_decode_weights_are_the_linear_layers(tiny_llm):
    weights = bm.decode_weights(tiny_llm.model)
    assert len(weights) == 4 * TINY.num_layers + 1
    assert weights[-1].shape == (TINY.vocab_size, TINY.hidden_size)


@pytest.fixture
def one_thread():
    """One torch thread: on a shared machine a 2-thread matmul waits for a descheduled helper thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_matmul_floor_is_positive_and_batching_is_nearly_free(tiny_llm, one_thread):
    one = bm.matmul_floor(tiny_llm.model, batch_size=1, steps=20)
    eight = bm.matmul_floor(tiny_llm.model, batch_size=8, steps=20)
    assert one.tpot_s > 0 and one.ttft_s is None and one.engine == "matmul floor"
    assert one.decode_tokens_per_s == pytest.approx(1 / one.tpot_s)
    # on a tiny model a step costs about the same for 1 or 8 rows: expect ~8x the tokens/s, ask for > 2x
    assert eight.decode_tokens_per_s > 2 * one.decode_tokens_per_s


def test_make_prompts_are_reproducible_and_in_range():
    a = bm.make_prompts(TINY.vocab_size, 5, 7, seed=3)
    assert a == bm.make_prompts(TINY.vocab_size, 5, 7, seed=3)
    assert len(a) == 5 and all(len(p) == 7 for p in a)
    assert all(100 <= t < TINY.vocab_size for p in a for t in p)
    assert len({tuple(p) for p in a}) == 5


def test_time_minfer_counts_the_tokens_it_generated(tiny_llm):
    prompts = bm.make_prompts(TINY.vocab_size, 3, 6)
    t = bm.time_minfer(tiny_llm, prompts, max_tokens=5, batch_size=4)  # more rows than prompts: they repeat
    assert (t.engine, t.dtype, t.batch_size, t.num_output_tokens, t.prompt_len) == ("minfer", "float32", 4, 5, 6)
    assert t.ttft_s > 0 and t.tpot_s > 0
    assert t.decode_tokens_per_s == pytest.approx(4 / t.tpot_s)
    ids = t.extra["token_ids"]
    assert len(ids) == 4 and all(len(row) == 5 for row in ids)
    assert ids[3] == ids[0]  # row 3 is prompt 0 again, greedy: same tokens
    assert tiny_llm.engine.scheduler.max_num_seqs == 32  # the temporary batch limit was put back


def test_time_minfer_rejects_a_single_token():
    with pytest.raises(ValueError, match="max_tokens"):
        bm.time_minfer(None, [[1, 2]], max_tokens=1)


def test_transformers_generates_the_same_tokens_as_minfer(random_tiny_dir, tiny_llm):
    hf, tok = common.load_transformers(random_tiny_dir, "float32", "cpu")
    prompts = bm.make_prompts(TINY.vocab_size, 2, 6, seed=5)
    theirs = bm.time_transformers(hf, tok, prompts, max_tokens=6, batch_size=2)
    ours = bm.time_minfer(tiny_llm, prompts, max_tokens=6, batch_size=2)
    assert (theirs.engine, theirs.batch_size, theirs.num_output_tokens) == ("transformers", 2, 6)
    assert theirs.ttft_s > 0 and theirs.tpot_s > 0
    assert theirs.extra["token_ids"] == ours.extra["token_ids"]  # same weights, greedy: the same work
    assert hf.generation_config.eos_token_id == tok.eos_token_id  # switched off only during the call


def test_mbu_is_weight_bytes_per_step_over_bandwidth():
    assert bm.model_bandwidth_utilisation(1e9, 0.02, 100e9) == pytest.approx(0.5)
    t = bm.Timing("minfer", "float32", 1, 0.1, 0.05, 10)
    assert bm.model_bandwidth_utilisation(540e6, t.tpot_s, 54e9) == pytest.approx(540e6 * t.decode_tokens_per_s / 54e9)


def test_best_of_keeps_the_fastest():
    runs = [bm.Timing("minfer", "float32", 1, 0.3, 0.02, 4), bm.Timing("minfer", "float32", 1, 0.1, 0.03, 4)]
    best = bm.best_of(runs)
    assert (best.tpot_s, best.ttft_s) == (0.02, 0.1)


def test_run_benchmark_table_and_docs_section(tmp_path):
    result = bm.run_generate_benchmark(random_weights="tiny", dtypes=["float32"], batch_sizes=[1, 2], max_tokens=3,
                                       prompt_len=4, repeats=1, floor_steps=2, progress=False, bandwidth_mb=8)
    engines = {(r["engine"], r["batch_size"]) for r in result["rows"]}
    assert engines == {(e, b) for e in ("minfer", "transformers", "matmul floor") for b in (1, 2)}
    assert all(r["mbu"] > 0 and r["decode_tokens_per_s"] > 0 for r in result["rows"])
    (ratio,) = [e for e in result["ratios"] if e["batch_size"] == 1]
    rows = {r["engine"]: r for r in result["rows"] if r["batch_size"] == 1}
    assert ratio["minfer_vs_transformers"] == pytest.approx(rows["minfer"]["decode_tokens_per_s"]
                                                            / rows["transformers"]["decode_tokens_per_s"])
    json.dumps(result)  # JSON-able
    table = bm.format_markdown(result, command="python -m minfer bench --x")
    assert "| float32 | 2 | minfer |" in table and "python -m minfer bench --x" in table
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nintro kept\n")
    bm.update_docs(table, docs)
    bm.update_docs(table.replace("--x", "--y"), docs)
    text = docs.read_text()
    assert text.count(bm.DOCS_START) == 1 and text.count(bm.DOCS_END) == 1
    assert "intro kept" in text and "--y" in text and "--x" not in text


def test_cli_bench_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    rc = main(["bench", "--random-weights", "tiny", "--quick", "--dtypes", "bfloat16", "--batch-sizes", "2",
               "--engines", "minfer", "--max-tokens", "3", "--floor-steps", "2", "--no-progress",
               "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert {r["engine"] for r in result["rows"]} == {"minfer", "matmul floor"}
    assert result["settings"]["max_tokens"] == 3 and result["rows"][0]["dtype"] == "bfloat16"
    assert md.read_text() in capsys.readouterr().out


def test_bench_script_and_cli_share_the_options():
    script = subprocess.run([sys.executable, "benchmarks/bench_generate.py", "--help"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    cli = subprocess.run([sys.executable, "-m", "minfer", "bench", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    for option in ("--quick", "--json", "--update-docs", "--random-weights", "--device", "--batch-sizes"):
        assert option in script and option in cli


def test_cli_demo_streams_and_prints_timings(random_tiny_dir):
    proc = subprocess.run([sys.executable, "-m", "minfer", "demo", "--model", random_tiny_dir, "--prompt", "t5 t6 t7",
                           "--max-tokens", "4", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout and "TPOT" in proc.stdout and "tokens/s" in proc.stdout


def test_cli_demo_with_the_real_model(capsys):
    assert main(["demo", "--prompt", "Say hi.", "--max-tokens", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "> Say hi." in out and "TTFT" in out and "(3 tokens)" in out


def test_cli_bad_model_is_an_error_message(capsys):
    assert main(["demo", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_gpu_check_script_runs_on_cpu_with_tiny_shapes(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, DEVICE="cpu", SHAPES="tiny",
               BENCH_ARGS="--max-tokens 3 --repeats 1 --floor-steps 2 --batch-sizes 1 2 --dtypes float32")
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "bench_generate.json").read_text())
    assert result["machine"]["device"] == "cpu" and "tiny" in result["model"]
    assert "Command: `python -m minfer bench --random-weights tiny" in (tmp_path / "out" / "bench_generate.md").read_text()
    assert "torch" in (tmp_path / "out" / "env.txt").read_text()


def test_time_minfer_computes_every_prompt_token(tiny_llm):
    """The warm-up must not leave the prompts in the prefix cache, or TTFT would time a cache hit."""
    prompts = bm.make_prompts(tiny_llm.config.vocab_size, 2, 40)
    scheduler = tiny_llm.engine.scheduler
    cached_before = scheduler.cached_prompt_tokens
    bm.time_minfer(tiny_llm, prompts, max_tokens=3, batch_size=2)
    assert scheduler.cached_prompt_tokens == cached_before
    assert tiny_llm.engine.blocks.enable_prefix_caching  # restored afterwards
