"""benchmarks/gpu_check.sh's notebook part, rehearsed on the CPU: every notebook run within its budget into the
output folder, figures and a summary beside them, the GPU cells' figures in OUT/gpu; failures and timeouts named."""
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent

CELLS = {
    "a_ok": ["import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()",
             "from minfer.bench.gpu_figures import gpu_cell\n"
             "gpu_cell('ch99', 'rehearsal', lambda: {'batch': [1, 2], 'tokens/s': [3.0, 5.0]}, '../docs/gpu')"],
    "b_error": ["x = 1", "raise RuntimeError('planted failure')", "print('never')"],
    "c_slow": ["import time\ntime.sleep(60)"],
}


@pytest.mark.slow
def test_gpu_check_runs_notebooks_into_its_output_folder(tmp_path):
    books = []
    for name, cells in CELLS.items():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
        books.append(str(tmp_path / f"{name}.ipynb"))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, DEVICE="cpu", PARTS="notebooks", NOTEBOOKS=" ".join(books),
               NB_TIMEOUT="20", TOTAL_LIMIT="150")
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode != 0, "a failing notebook must fail the check"
    rows = {r["notebook"]: r for r in json.loads((out / "summary.json").read_text())}
    assert [rows[f"{n}.ipynb"]["status"] for n in CELLS] == ["ok", "error", "timeout"], proc.stdout[-3000:]
    assert rows["b_error.ipynb"]["cell"] == 1 and "planted failure" in rows["b_error.ipynb"]["error"]
    assert "| b_error.ipynb | error |" in (out / "summary.md").read_text()
    figures = json.loads((out / "gpu" / "ch99.json").read_text())  # the rehearsal measured, on this CPU
    assert figures["columns"]["tokens/s"] == [3.0, 5.0] and figures["device"].startswith("CPU")
    executed = nbformat.read(out / "notebooks" / "a_ok.ipynb", as_version=4)
    assert "rehearsal: measured on CPU" in "".join(o.get("text", "") for o in executed.cells[1].outputs)
    assert len(list((out / "figures").glob("a_ok_cell00_*.png"))) == 1
    assert nbformat.read(tmp_path / "a_ok.ipynb", as_version=4).cells[0].outputs == []  # the originals untouched
    assert not (REPO / "docs" / "gpu" / "ch99.json").exists()  # a rehearsal never writes docs/gpu
