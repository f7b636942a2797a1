"""The timing helpers of minfer.lab.bench.generate and minfer.lab.bench.common, on a tiny random model (fast), and the CLI.

No absolute timing is asserted (the machine is shared). The arithmetic of each timing is checked
exactly against a fake clock; real timings only against bounds from first principles (a request's
timeline fits inside the call that ran it, no engine beats the bare matmuls) or against an
independent measurement, with 3x headroom.
"""
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.__main__ import main
from minfer.lab.bench import common
from minfer.lab.bench import decode_speed, generate, generate_report, timing, transformers_timing
from minfer.lab.testing import MODEL_SHAPES, random_checkpoint

REPO = Path(__file__).resolve().parent.parent
TINY = MODEL_SHAPES["tiny"]


def tiny_params() -> int:
    """Parameters one decode step reads in the tiny shape, counted by hand: per layer q/k/v, o, gate/up/down
    and two norms, then the final norm and the tied head (the embedding is not read in full)."""
    c = TINY
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    return c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size


@pytest.fixture(scope="module")
def tiny_llm(make_tiny_llm) -> LLM:
    return make_tiny_llm("random")


@pytest.fixture
def fake_clock(monkeypatch):
    """Replace the harness's clock: each read returns the next of the given times."""
    def install(*times: float) -> None:
        reads = iter(times)
        monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=lambda: next(reads)))
    return install


def test_memory_bandwidth_counts_read_and_write_of_the_fastest_copy(fake_clock):
    fake_clock(0.0, 3.0, 10.0, 12.0)  # two copies: 3 s, then 2 s
    assert decode_speed.measure_memory_bandwidth(size_mb=1, repeats=2) == 2 * 2**20 / 2.0  # 1 MiB read + 1 MiB written in 2 s


def test_memory_bandwidth_agrees_with_a_numpy_copy():
    """The same measurement made independently (numpy, same size) lands within 3x."""
    import numpy as np

    bw = decode_speed.measure_memory_bandwidth(size_mb=16, repeats=5)
    src = np.ones(16 * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    assert 1 / 3 < bw / (2 * src.nbytes / best) < 3


def test_weight_bytes_counts_every_matrix_once(tiny_llm):
    assert decode_speed.weight_bytes(tiny_llm.model) == 4 * tiny_params()
    bf16 = LLM(tiny_llm.model_path, dtype="bfloat16", device="cpu")
    assert decode_speed.weight_bytes(bf16.model) * 2 == decode_speed.weight_bytes(tiny_llm.model)


def test_weight_bytes_skips_an_untied_embedding(tmp_path):
    from dataclasses import replace

    untied = random_checkpoint(str(tmp_path), replace(TINY, tie_word_embeddings=False))
    model = LLM(untied, dtype="float32", device="cpu").model
    all_params = sum(p.numel() * p.element_size() for p in model.parameters())
    # the head is read in full each step, the embedding only one row per token
    assert decode_speed.weight_bytes(model) == all_params - model.embed_tokens.weight.nbytes


def test_decode_weights_are_the_linear_layers(tiny_llm):
    weights = decode_speed.decode_weights(tiny_llm.model)
    assert len(weights) == 4 * TINY.num_layers + 1
    assert weights[-1].shape == (TINY.vocab_size, TINY.hidden_size)


@pytest.fixture
def one_thread():
    """One torch thread: on a shared machine a 2-thread matmul waits for a descheduled helper thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_matmul_floor_is_the_fastest_run_per_step(tiny_llm, fake_clock):
    fake_clock(0.0, 4.0, 10.0, 13.0)  # two runs of 20 steps: 4 s, then 3 s
    floor = decode_speed.matmul_floor(tiny_llm.model, batch_size=8, steps=20, warmup=0, repeats=2)
    assert (floor.engine, floor.dtype, floor.batch_size, floor.ttft_s) == ("matmul floor", "float32", 8, None)
    assert floor.tpot_s == pytest.approx(3.0 / 20)
    assert floor.decode_tokens_per_s == pytest.approx(8 / 0.15)


def test_matmul_floor_batching_is_nearly_free(tiny_llm, one_thread):
    one = decode_speed.matmul_floor(tiny_llm.model, batch_size=1, steps=20)
    eight = decode_speed.matmul_floor(tiny_llm.model, batch_size=8, steps=20)
    # on a tiny model a step costs about the same for 1 or 8 rows: expect ~8x the tokens/s, ask for > 2x
    assert eight.decode_tokens_per_s > 2 * one.decode_tokens_per_s


def test_make_prompts_are_reproducible_and_in_range():
    a = decode_speed.make_prompts(TINY.vocab_size, 5, 7, seed=3)
    assert a == decode_speed.make_prompts(TINY.vocab_size, 5, 7, seed=3)
    assert len(a) == 5 and all(len(p) == 7 for p in a)
    assert all(100 <= t < TINY.vocab_size for p in a for t in p)
    assert len({tuple(p) for p in a}) == 5


def test_time_minfer_counts_the_tokens_it_generated(tiny_llm):
    prompts = decode_speed.make_prompts(TINY.vocab_size, 3, 6)
    start = time.perf_counter()
    t = decode_speed.time_minfer(tiny_llm, prompts, max_tokens=5, batch_size=4, warmup=False)  # more rows than prompts: they repeat
    wall = time.perf_counter() - start
    assert (t.engine, t.dtype, t.batch_size, t.num_output_tokens, t.prompt_len) == ("minfer", "float32", 4, 5, 6)
    # TTFT + 4 TPOT is a request's whole timeline (arrival to last token): inside the call, and most of it
    assert wall / 3 < t.ttft_s + 4 * t.tpot_s <= wall
    ids = t.extra["token_ids"]
    assert len(ids) == 4 and all(len(row) == 5 for row in ids)
    assert ids[3] == ids[0]  # row 3 is prompt 0 again, greedy: same tokens
    assert tiny_llm.engine.scheduler.max_num_seqs == 32  # the temporary batch limit was put back


def test_time_minfer_rejects_a_single_token():
    with pytest.raises(ValueError, match="max_tokens"):
        decode_speed.time_minfer(None, [[1, 2]], max_tokens=1)


def test_transformers_generates_the_same_tokens_as_minfer(random_tiny_dir, tiny_llm):
    hf, tok = common.load_transformers(random_tiny_dir, "float32", "cpu")
    prompts = decode_speed.make_prompts(TINY.vocab_size, 2, 6, seed=5)
    start = time.perf_counter()
    theirs = transformers_timing.time_transformers(hf, tok, prompts, max_tokens=6, batch_size=2, warmup=False)
    wall = time.perf_counter() - start
    ours = decode_speed.time_minfer(tiny_llm, prompts, max_tokens=6, batch_size=2)
    assert (theirs.engine, theirs.batch_size, theirs.num_output_tokens) == ("transformers", 2, 6)
    assert wall / 3 < theirs.ttft_s + 5 * theirs.tpot_s <= wall  # generate's first step to its last, inside the call
    assert theirs.extra["token_ids"] == ours.extra["token_ids"]  # same weights, greedy: the same work
    assert hf.generation_config.eos_token_id == tok.eos_token_id  # switched off only during the call


def test_mbu_is_weight_bytes_per_step_over_bandwidth():
    assert decode_speed.model_bandwidth_utilisation(1e9, 0.02, 100e9) == pytest.approx(0.5)
    assert decode_speed.model_bandwidth_utilisation(540e6, 0.05, 54e9) == pytest.approx(0.2)  # 540 MB x 20 steps/s of 54 GB/s
    assert timing.Timing("minfer", "float32", 4, 0.1, 0.02, 10).decode_tokens_per_s == pytest.approx(200)  # 4 rows / 20 ms


def test_decode_kv_bytes_is_the_mean_context_of_the_decode_steps():
    # prompts of 4, 3 new tokens: the decode steps attend over 5 and 6 tokens
    assert decode_speed.decode_kv_bytes(10, batch=2, prompt_tokens=4, new_tokens=3) == 2 * (5 + 6) / 2 * 10


def test_best_of_keeps_the_fastest():
    runs = [timing.Timing("minfer", "float32", 1, 0.3, 0.02, 4), timing.Timing("minfer", "float32", 1, 0.1, 0.03, 4)]
    best = timing.best_of(runs)
    assert (best.tpot_s, best.ttft_s) == (0.02, 0.1)


@pytest.mark.slow
def test_run_benchmark_table_and_docs_section(tmp_path):
    result = generate.run_generate_benchmark(random_weights="tiny", dtypes=["float32"], batch_sizes=[1, 2], max_tokens=3,
                                       prompt_len=4, repeats=1, floor_steps=2, progress=False, bandwidth_mb=8)
    rows = {(r["engine"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {(e, b) for e in ("minfer", "transformers", "matmul floor", "F.linear floor") for b in (1, 2)}
    assert result["weight_bytes_per_step"] == {"float32": 4 * tiny_params()}
    for b in (1, 2):
        (ratio,) = [e for e in result["ratios"] if e["batch_size"] == b]
        # the floor is the zero-overhead bound: neither engine decodes faster than the bare matmuls
        assert ratio["minfer_vs_floor"] < 1 and ratio["transformers_vs_floor"] < 1
        # the same batch, so the ratio of decode speeds is the inverse ratio of TPOTs
        assert ratio["minfer_vs_transformers"] == pytest.approx(rows["transformers", b]["tpot_s"] / rows["minfer", b]["tpot_s"])
        # MBU divides by the same bytes and bandwidth for every engine: MBU ratios are speed ratios
        assert rows["minfer", b]["mbu"] / rows["matmul floor", b]["mbu"] == pytest.approx(ratio["minfer_vs_floor"])
    json.dumps(result)  # JSON-able
    table = generate_report.format_markdown(result, command="python -m minfer bench --x")
    assert "| float32 | 2 | minfer |" in table and "python -m minfer bench --x" in table
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nintro kept\n")
    generate_report.update_docs(table, docs)
    generate_report.update_docs(table.replace("--x", "--y"), docs)
    text = docs.read_text()
    assert text.count(generate_report.DOCS_START) == 1 and text.count(generate_report.DOCS_END) == 1
    assert "intro kept" in text and "--y" in text and "--x" not in text


@pytest.mark.slow
def test_cli_bench_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    rc = main(["bench", "--random-weights", "tiny", "--quick", "--dtypes", "bfloat16", "--batch-sizes", "2",
               "--engines", "minfer", "--max-tokens", "3", "--floor-steps", "2", "--no-progress",
               "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert {r["engine"] for r in result["rows"]} == {"minfer", "matmul floor", "F.linear floor"}
    assert result["settings"]["max_tokens"] == 3 and result["rows"][0]["dtype"] == "bfloat16"
    assert md.read_text() in capsys.readouterr().out


BENCH_OPTIONS = ["-h", "--quick", "--model", "--random-weights", "--device", "--dtypes", "--batch-sizes", "--engines",
                 "--max-tokens", "--prompt-len", "--repeats", "--floor-steps", "--threads", "--json", "--markdown",
                 "--update-docs", "--no-progress"]


def test_bench_script_and_cli_share_the_options(capsys):
    script = subprocess.run([sys.executable, "benchmarks/bench_generate.py", "--help"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    cli = capsys.readouterr().out
    options = lambda text: re.findall(r"^  (--?[a-z][\w-]*)", text, re.M)
    assert options(script) == options(cli) == BENCH_OPTIONS
    # the script knows its checkout's docs page; the CLI, installed anywhere, must be told where it is
    assert re.search(r"^  --update-docs \[PATH\]", script, re.M) and re.search(r"^  --update-docs PATH", cli, re.M)
    with pytest.raises(SystemExit) as done:
        main(["bench", "--update-docs"])
    assert done.value.code == 2 and "--update-docs: expected one argument" in capsys.readouterr().err


TIMINGS = re.compile(r"^TTFT \d+ ms \((\d+) prompt tokens\) \| TPOT ([\d.]+) ms \| ([\d.]+) tokens/s \((\d+) tokens\)$")


def check_demo_output(out: str, prompt: str, answer: str, num_prompt_tokens: int, num_tokens: int) -> None:
    """The prompt, the streamed answer (what greedy generate gives), then one line of timings."""
    head, timings = out.rstrip("\n").rsplit("\n", 1)
    assert head == f"> {prompt}\n\n{answer}\n"
    match = TIMINGS.match(timings)
    assert match, timings
    assert (int(match[1]), int(match[4])) == (num_prompt_tokens, num_tokens)
    tpot_ms, tokens_per_s = float(match[2]), float(match[3])
    # tokens/s is 1 / TPOT, both printed to one decimal (so each within 0.05 of the true value)
    assert tokens_per_s * tpot_ms / 1000 == pytest.approx(1, abs=0.05 / tpot_ms + 0.05 / tokens_per_s)


@pytest.mark.slow
def test_cli_demo_streams_and_prints_timings(random_tiny_dir, tiny_llm):
    proc = subprocess.run([sys.executable, "-m", "minfer", "demo", "--model", random_tiny_dir, "--prompt", "t5 t6 t7",
                           "--max-tokens", "4", "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    answer = tiny_llm.generate("t5 t6 t7", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(answer.token_ids) == 4  # no EOS from this model on this prompt: the demo's count is known
    check_demo_output(proc.stdout, "t5 t6 t7", answer.text, 3, 4)  # a base model: no chat template, 3 word tokens


@pytest.mark.slow
def test_cli_demo_with_the_real_model(capsys, llm):
    assert main(["demo", "--prompt", "Say hi.", "--max-tokens", "3", "--device", "cpu"]) == 0
    prompt = llm.apply_chat_template([{"role": "user", "content": "Say hi."}])
    answer = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    check_demo_output(capsys.readouterr().out, "Say hi.", answer.outputs[0].text, len(answer.prompt_token_ids), 3)


def test_cli_bad_model_is_an_error_message(capsys):
    assert main(["demo", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_gpu_check_script_runs_on_cpu_with_tiny_shapes(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, DEVICE="cpu", SHAPES="tiny", PARTS="bench",
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
    prompts = decode_speed.make_prompts(tiny_llm.config.vocab_size, 2, 40)
    scheduler = tiny_llm.engine.scheduler
    cached_before = scheduler.cached_prompt_tokens
    decode_speed.time_minfer(tiny_llm, prompts, max_tokens=3, batch_size=2)
    assert scheduler.cached_prompt_tokens == cached_before
    assert tiny_llm.engine.blocks.enable_prefix_caching  # restored afterwards
