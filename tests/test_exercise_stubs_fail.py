"""The exercise stubs must fail every chapter test: a test that passes on a stub checks nothing.

Also: every public function in exercises/ is a stub with a worked twin in solutions/ of the
same signature, so the notebooks can switch between the two.
"""
import inspect
import os
import subprocess
import sys

import pytest

from minfer.lab.course import REPO_ROOT, load_impl, run_tests

CHAPTERS = sorted(p.stem for p in (REPO_ROOT / "exercises").glob("ch*.py"))


def public_functions(module) -> dict:
    return {name: fn for name, fn in inspect.getmembers(module, inspect.isfunction)
            if not name.startswith("_") and fn.__module__ == module.__name__}


def test_there_are_chapters():
    assert {"ch00_measure", "ch01_model", "ch02_kv_cache", "ch03_paged_attention", "ch04_continuous_batching",
            "ch05_prefix_caching", "ch06_quantization", "ch06b_ptq_and_qat", "ch07_speculative_decoding",
            "ch08_distillation_and_routing", "ch09_serving_under_load",
            "ch10_mixture_of_experts", "ch11_scaling_out", "ch12_host_overhead"} <= set(CHAPTERS)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_stub_raises_and_has_a_solution(chapter):
    chapter_id = chapter.split("_")[0]  # ch01_model -> ch01
    stubs = public_functions(load_impl(chapter_id, "exercises"))
    worked = public_functions(load_impl(chapter_id, "solutions"))
    assert stubs, f"exercises/{chapter}.py has no functions"
    assert set(stubs) == set(worked), "exercises and solutions must offer the same functions"
    for name, stub in stubs.items():
        assert inspect.signature(stub) == inspect.signature(worked[name]), name
        assert inspect.getdoc(stub), f"{name} needs a docstring stating its contract"
        # call with placeholder arguments: a stub must raise before it touches any of them
        args = [None] * len([p for p in inspect.signature(stub).parameters.values() if p.default is p.empty])
        with pytest.raises(NotImplementedError):
            stub(*args)


@pytest.mark.slow
def test_every_exercise_test_fails_on_the_stubs():
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/exercises"],
        cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )  # as run_tests runs them: without plugins
    test_ids = [line for line in collected.stdout.splitlines() if "::" in line]
    assert test_ids, collected.stdout + collected.stderr
    results = run_tests(["tests/exercises"], impl="exercises")
    passed = sorted(r.name for r in results if r.outcome == "passed")
    assert passed == [], f"these tests pass on the untouched stubs: {passed}"
    failed = [r for r in results if r.outcome in ("failed", "error")]
    assert len(failed) == len(test_ids)
