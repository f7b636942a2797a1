"""The router benchmark's report: rendered from a run's rows, it finds the operating point and writes the docs section."""
import importlib.util
import json
import random

from minfer.lab.router import SIGNALS
from minfer.lab.router_tasks import make_tasks
from minfer.lab.course import REPO_ROOT

spec = importlib.util.spec_from_file_location("bench_router", REPO_ROOT / "benchmarks" / "bench_router.py")
bench_router = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_router)


def fake_run() -> dict:
    """A run's result as `run` returns it, with made-up rows: a cheap model right on 3 tasks in 4,
    confident when right; a full model right on 9 in 10."""
    rng = random.Random(0)
    tasks = make_tasks(3)
    full = [{"kind": t.kind, "correct": rng.random() < 0.9, "seconds": 1.0, "answer": "x"} for t in tasks]
    cheap = []
    for t in tasks:
        right = rng.random() < 0.75
        confidence = rng.uniform(0.5, 1.0) if right else rng.uniform(0.0, 0.6)
        cheap.append({"kind": t.kind, "correct": right, "seconds": 0.25, "answer": "y",
                      **{s: confidence for s in SIGNALS}})
    studies = {"int4-awq": bench_router.RouterStudy("int4-awq", 0.25, cheap, full)}
    best = studies["int4-awq"]
    return {"machine": "test", "threads": 1, "dtype": "float32", "max_tokens": 16, "num_tasks": len(tasks),
            "full_accuracy": best.full_accuracy, "candidates": {n: s.summary() for n, s in studies.items()},
            "chosen": "int4-awq", "operating_point": best.operating_point.__dict__,
            "timed_cost": best.timed_cost(best.operating_point), "full_rows": full, "cheap_rows": {"int4-awq": cheap}}


def test_report_from_saved_rows(tmp_path):
    result = json.loads(json.dumps(fake_run()))  # as saved by --json and read back by --render
    study = bench_router.saved_studies(result)["int4-awq"]
    op = study.operating_point
    assert op.accuracy >= study.full_accuracy and 0 < op.share_cheap < 1  # a separating signal: some stay cheap
    assert op.cost_with_classifier == 0.25 + 1 - op.share_cheap
    text = bench_router.markdown(result, "cmd")
    assert f"threshold {op.threshold:.3f}: {op.share_cheap:.0%} served cheap" in text
    assert "0.7 × 0.1 + 0.3 × 1 = 0.37" in text and "| int4-awq |" in text and "(operating point)" in text
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    bench_router.write_docs_section(text, str(page), bench_router.DOCS_START, bench_router.DOCS_END,
                                    heading="## Routing")
    assert text in page.read_text()


def test_cheapest_study_skips_a_model_that_is_never_right():
    """A near-free model that answers nothing right posts the lowest cost (c + 1 at its escalate-all point) yet
    gives a router nothing to separate: the pick is the routable one, and a lone never-right model still gets one."""
    saved = bench_router.saved_studies(json.loads(json.dumps(fake_run())))["int4-awq"]
    routable = bench_router.RouterStudy("int8", 0.95, saved.cheap_rows, saved.full_rows)  # a dear cheap model
    never_right = bench_router.RouterStudy("draft", 0.01, [{**r, "correct": False} for r in routable.cheap_rows],
                                           routable.full_rows)
    assert routable.routable and not never_right.routable and never_right.auc("min_prob") is None
    assert never_right.operating_point.cost_with_classifier < routable.operating_point.cost_with_classifier
    assert bench_router.cheapest_study([never_right, routable]) is routable
    assert bench_router.cheapest_study([never_right]) is never_right
