"""The notebooks as a learner sees them: tests/browser/notebooks_in_browser.py (also `make test-browser`),
JupyterLab in headless Chromium, run as one test of the suite so that it shares the cores with the others
instead of running after them. Its report and screenshots go to $SCREENSHOTS (default build/screenshots)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM, reason="no chromium on PATH (Debian: apt-get install chromium; "
                                         "or CHROMIUM=/path/to/it)")
def test_every_notebook_renders_in_jupyterlab_in_chromium():
    screenshots = Path(os.environ.get("SCREENSHOTS") or ROOT / "build" / "screenshots")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "browser" / "notebooks_in_browser.py"),
         "--screenshots", str(screenshots), "--chromium", CHROMIUM],
        capture_output=True, text=True, timeout=1500, cwd=ROOT,
        env=dict(os.environ, MINFER_IMPL=os.environ.get("MINFER_IMPL", "solutions")))
    report = result.stdout + result.stderr
    (screenshots / "report.txt").write_text(report)
    assert result.returncode == 0, report[-6000:]


def notebook_with(path: Path, sources_and_seconds: list[tuple[str, float]]) -> Path:
    """A notebook of code cells, each with the run time nbclient would have recorded."""
    cells = [{"cell_type": "code", "source": source, "outputs": [], "execution_count": None,
              "metadata": {"execution": {"iopub.execute_input": "2026-01-01T00:00:00Z",
                                         "shell.execute_reply": f"2026-01-01T00:00:{seconds:06.3f}Z"}}}
             for source, seconds in sources_and_seconds]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_each_kind_of_live_check_runs_in_the_quickest_notebook_whatever_the_budget(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "browser"))
    from notebooks_in_browser import bring_each_kind_to_life, plan_notebook

    slider = "from ipywidgets import IntSlider, interact\ninteract(lambda n: print(n * x), n=IntSlider(1))"
    glass = "from minfer.lab.glass import GlassEngine\nGlassEngine(x)"
    books = {"a": [("import os", 0.5), ("x = 2", 3.0), (slider, 0.5)],        # a slider for 4 s
             "b": [("import os", 0.5), ("x = 2", 1.0), (slider, 0.5)],        # a slider for 2 s: the quickest
             "c": [("import os", 0.5), ("x = 2", 9.0), (glass, 0.5), (slider, 0.1)]}  # the only glass engine
    paths = [notebook_with(tmp_path / f"{name}.ipynb", cells) for name, cells in books.items()]

    plans = [plan_notebook(path, live_budget_s=1.0) for path in paths]  # nothing fits the budget
    assert [plan.live_cells for plan in plans] == [[], [], []]
    bring_each_kind_to_life(plans)
    assert [(plan.run_cells, plan.live_cells) for plan in plans] == [([], []), ([0, 1, 2], [2]), ([0, 1, 2], [2])]

    plans = [plan_notebook(path, live_budget_s=5.0) for path in paths]  # both sliders fit; the glass engine joins
    bring_each_kind_to_life(plans)
    assert [plan.live_cells for plan in plans] == [[2], [2], [2]]
