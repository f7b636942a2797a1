"""benchmarks/gpu_check.sh's notebook parts, rehearsed on the CPU: whole notebooks (PARTS=notebooks) run within
their budget into the output folder, figures and a summary beside them, the GPU cells' figures in OUT/gpu, failures
and timeouts named; the gpu-cells part runs only the GPU cells and the cells they need; and the cell-dependency
analysis that picks those cells (minfer.lab.bench.notebook_cells)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minfer.lab.bench.notebook_cells import cells_calling, defined_and_read, needed_cells

REPO = Path(__file__).resolve().parent.parent

CELLS = {
    "a_ok": ["import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()",
             "from minfer.lab.bench.gpu_figures import gpu_cell\n"
             "gpu_cell('ch99', 'rehearsal', lambda: {'batch': [1, 2], 'tokens/s': [3.0, 5.0]}, '../docs/gpu')"],
    "b_error": ["x = 1", "raise RuntimeError('planted failure')", "print('never')"],
    "c_slow": ["import time\ntime.sleep(60)"],
}

# gpu-cells: cell 4 (the GPU cell) needs 0 (set-up), 1 (rate, mutated by 3) and 3; never 2 (slow) or 5 (raises)
GPU_CELLS = {
    "g_gpu": ["import time\nfrom minfer.lab.bench.gpu_figures import gpu_cell",
              "class Box:\n    pass\nrate = Box()\nrate.value = 2.0",
              "time.sleep(30)\nslow = 1",
              "rate.value *= 4",
              "def measure():\n    return {'batch': [1, 2], 'tokens/s': [rate.value, 2 * rate.value]}\n"
              "gpu_cell('ch98', 'gpu cells only', measure, '../docs/gpu')",
              "raise RuntimeError('an unrelated cell ran')"],
    "h_plain": ["x = 1", "print(x)"],
}


def write_notebooks(folder: Path, books: dict[str, list[str]]) -> list[str]:
    paths = []
    for name, cells in books.items():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nbformat.write(nb, folder / f"{name}.ipynb")
        paths.append(str(folder / f"{name}.ipynb"))
    return paths


def gpu_check(out: Path, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, DEVICE="cpu", **env)
    return subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out)], env=env, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.slow
def test_gpu_check_runs_notebooks_into_its_output_folder(tmp_path):
    books = write_notebooks(tmp_path, CELLS)
    out = tmp_path / "out"
    proc = gpu_check(out, PARTS="notebooks", NOTEBOOKS=" ".join(books), NB_TIMEOUT="20", TOTAL_LIMIT="150")
    assert proc.returncode != 0, "a failing notebook must fail the check"
    part = out / "whole-notebooks"
    rows = {r["notebook"]: r for r in json.loads((part / "summary.json").read_text())}
    assert [rows[f"{n}.ipynb"]["status"] for n in CELLS] == ["ok", "error", "timeout"], proc.stdout[-3000:]
    assert rows["b_error.ipynb"]["cell"] == 1 and "planted failure" in rows["b_error.ipynb"]["error"]
    assert "| b_error.ipynb | error |" in (part / "summary.md").read_text()
    assert "## whole-notebooks" in (out / "summary.md").read_text()  # gathered by gpu_check.sh
    figures = json.loads((out / "gpu" / "ch99.json").read_text())  # the rehearsal measured, on this CPU
    assert figures["columns"]["tokens/s"] == [3.0, 5.0] and figures["device"].startswith("CPU")
    executed = nbformat.read(part / "notebooks" / "a_ok.ipynb", as_version=4)
    assert "rehearsal: measured on CPU" in "".join(o.get("text", "") for o in executed.cells[1].outputs)
    assert len(list((part / "figures").glob("a_ok_cell00_*.png"))) == 1
    assert nbformat.read(tmp_path / "a_ok.ipynb", as_version=4).cells[0].outputs == []  # the originals untouched
    assert not (REPO / "docs" / "gpu" / "ch99.json").exists()  # a rehearsal never writes docs/gpu


@pytest.mark.slow
def test_gpu_cells_part_runs_only_the_gpu_cells_and_what_they_need(tmp_path):
    books = write_notebooks(tmp_path, GPU_CELLS)
    out = tmp_path / "out"
    proc = gpu_check(out, PARTS="gpu-cells", NOTEBOOKS=" ".join(books), NB_TIMEOUT="25", TOTAL_LIMIT="120")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    part = out / "gpu-cells"
    rows = {r["notebook"]: r for r in json.loads((part / "summary.json").read_text())}
    assert rows["g_gpu.ipynb"]["status"] == "ok", rows
    assert rows["g_gpu.ipynb"]["cells"] == [0, 1, 3, 4]
    assert rows["g_gpu.ipynb"]["seconds"] < 25  # the slow cell never ran
    assert rows["h_plain.ipynb"]["status"] == "no gpu cell"
    assert not (part / "notebooks" / "h_plain.ipynb").exists()
    figures = json.loads((out / "gpu" / "ch98.json").read_text())
    assert figures["columns"]["tokens/s"] == [8.0, 16.0]  # cell 3's change to rate.value was run first
    executed = nbformat.read(part / "notebooks" / "g_gpu.ipynb", as_version=4)
    assert [c.execution_count is not None for c in executed.cells] == [True, True, False, True, True, False]
    assert "| g_gpu.ipynb | ok | " in (part / "summary.md").read_text()
    assert "| 0, 1, 3, 4 |" in (out / "summary.md").read_text()
    assert "no gpu cell" in (out / "summary.md").read_text()


def load_run_notebooks():
    spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "benchmarks" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_any_exception_becomes_an_error_row_and_the_summary_is_written(tmp_path, monkeypatch):
    run_notebooks = load_run_notebooks()

    class NoKernel:  # a kernel that cannot start: not one of nbclient's cell exceptions
        def __init__(self, *args, **kwargs):
            pass

        def setup_kernel(self):
            raise OSError("kernel failed to start: planted")

    monkeypatch.setattr(run_notebooks, "NotebookClient", NoKernel)
    books = write_notebooks(tmp_path, {"a": ["x = 1"], "b": ["from minfer.lab.bench.gpu_figures import gpu_cell\ngpu_cell()"]})
    out = tmp_path / "out"
    assert run_notebooks.main([str(out), *books, "--cells", "gpu"]) == 1
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["notebook"], r["status"]) for r in rows] == [("a.ipynb", "no gpu cell"), ("b.ipynb", "error")]
    assert rows[1]["error"] == "OSError: kernel failed to start: planted"
    assert "| b.ipynb | error |" in (out / "summary.md").read_text()


def code(*sources: str) -> list[dict]:
    return [nbformat.v4.new_code_cell(s) for s in sources]


def test_needed_cells_takes_the_last_earlier_definition():
    cells = code("import math", "a = 1", "a = 2", "b = a + 1", "a = 3", "print(b)")
    assert needed_cells(cells, [5]) == [0, 2, 3, 5]  # a = 2 (cell 2), not 1 or the later 3


def test_needed_cells_is_transitive_and_skips_markdown_and_unrelated_cells():
    cells = [nbformat.v4.new_markdown_cell("# title"),
             *code("import os", "p = 1", "q = p * 2", "unrelated = 5", "r = q + 1", "print(r)")]
    assert needed_cells(cells, [6]) == [1, 2, 3, 5, 6]
    assert needed_cells(cells, []) == []


def test_a_name_read_inside_a_function_body_counts():
    cells = code("pass", "scale = 3", "other = 4", "def f(x):\n    return x * scale", "f(2)")
    assert needed_cells(cells, [4]) == [0, 1, 3, 4]


def test_attribute_and_subscript_changes_count_as_definitions():
    cells = code("pass", "cfg = Cfg()\nd = {}", "cfg.size = 8", "d['k'] = 1", "unrelated = cfg", "print(cfg.size, d)")
    assert needed_cells(cells, [5]) == [0, 1, 2, 3, 5]
    defined, read = defined_and_read("x.y.z = 1\nw[0] += 2\ndef f():\n    v.a = 1")
    assert defined == {"x", "w", "f"} and {"x", "w", "v"} <= read  # (f.v changes only when called)


def test_a_name_read_before_the_cell_rebinds_it_comes_from_an_earlier_cell():
    cells = code("import os", "x = [1]", "y = 2", "x = x + [y]", "print(x)")
    assert needed_cells(cells, [4]) == [0, 1, 2, 3, 4]
    cells = code("pass", "n = 1", "n += 1\nm = n", "print(m)")
    assert needed_cells(cells, [3]) == [0, 1, 2, 3]
    cells = code("pass", "llm = 1", "llm = 2\nprint(llm)\nsq = [v * v for v in range(3)]\ndef f(a):\n    return a", "f(llm)")
    assert needed_cells(cells, [3]) == [0, 2, 3]  # bound before it is read, and comprehension/argument names are their own


def test_cells_calling_finds_gpu_cells_and_magics_parse():
    cells = code("%matplotlib inline\nimport torch", "from minfer.lab.bench.gpu_figures import gpu_cell",
                 "gpu_cell('ch00', 't', lambda: {}, 'x')", "figures.gpu_cell('ch00')", "gpu_cell_count = 1")
    assert cells_calling(cells, {"gpu_cell"}) == [2, 3]
