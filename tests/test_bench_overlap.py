"""benchmarks/bench_overlap.py on the tiny model: the synchronous engine, async scheduling and the benchmark's own
model-on-a-thread variant decode the same tokens, the engine's launch is put back, and the table reports them."""
import importlib.util
from pathlib import Path

from minfer.engine import engine as engine_module

spec = importlib.util.spec_from_file_location("bench_overlap", Path(__file__).parent.parent / "benchmarks" / "bench_overlap.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_three_engines_same_tokens_and_a_table(monkeypatch):
    launch = engine_module.launch
    monkeypatch.setitem(bench.BATCHES, "tiny", (1, 4))
    rows = bench.measure("tiny", "cpu", rounds=1, steps=3)
    assert engine_module.launch is launch
    assert [r["sequences"] for r in rows] == [1, 4] and all(r["same_tokens"] for r in rows)
    assert all(r[f"{name} ms"] > 0 for r in rows for name in ("synchronous", "async", "async, model on a thread"))
    table = bench.table(rows)
    assert "| tiny | 4 |" in table and "synchronous / async, model on a thread" in table and "| yes |" in table
