"""The notebooks as a learner sees them: tests/browser/notebooks_in_browser.py (also `make test-browser`),
JupyterLab in headless Chromium, run as one test of the suite so that it shares the cores with the others
instead of running after them. Its report and screenshots go to $SCREENSHOTS (default build/screenshots)."""
from __future__ import annotations

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
