"""benchmarks/bench_step_overhead.py's measurements on the tiny model: one figure per decode step, the
runner's time left out, the runner put back; and its report."""
import importlib.util
from pathlib import Path

import pytest

from minfer import LLM

spec = importlib.util.spec_from_file_location("bench_step_overhead",
                                              Path(__file__).parent.parent / "benchmarks" / "bench_step_overhead.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_one_overhead_per_decode_step_without_the_runner(tiny_dir, llm):
    tiny = LLM(tiny_dir, dtype="float32", device="cpu", max_num_seqs=2)
    run = tiny.engine.runner.run
    overheads = bench.engine_overhead_per_step(tiny, batch=2, tokens=40)
    assert len(overheads) == 39 and all(0 <= s < 1 for s in overheads)  # the prefill step is left out
    assert tiny.engine.runner.run == run and not tiny.has_unfinished_requests()
    text_rows = bench.text_cost_per_token(llm.tokenizer, list(range(300, 600)), [100, 300], repeats=1)
    assert [row[0] for row in text_rows] == [100, 300] and all(w > 0 and i > 0 for _, w, i in text_rows)
    logprob_rows = bench.stream_logprobs_cost(llm.tokenizer, list(range(300, 600)), [100, 300], repeats=1)
    assert [row[0] for row in logprob_rows] == [100, 300] and all(s > 0 and k > 0 for _, s, k in logprob_rows)
    table = bench.report(overheads * 300, text_rows, (0.010, 0.0005, 0.1), [(300, 0.002, 0.0001)], batch=2, tokens=40)
    assert "| 1–256 |" in table and "(20x less)" in table and "| 100 |" in table and "| 300 | 2.000 ms | 0.1000 ms | 20x |" in table


def test_the_runner_is_put_back_when_a_step_fails(tiny_dir):
    tiny = LLM(tiny_dir, dtype="float32", device="cpu", max_num_seqs=2)
    run = tiny.engine.runner.run

    def broken(batch, mask_logits=None, **kwargs):
        raise RuntimeError("broken runner")

    tiny.engine.runner.run = broken
    with pytest.raises(RuntimeError, match="broken runner"):
        bench.engine_overhead_per_step(tiny, batch=1, tokens=5)
    assert tiny.engine.runner.run is broken
    tiny.engine.runner.run = run
