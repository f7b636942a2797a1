"""Execute course notebooks into an output folder, each within a time budget (benchmarks/gpu_check.sh).

    python benchmarks/run_notebooks.py OUT_DIR notebooks/00_measure.ipynb ... [--budget 150] [--total 480]
                                       [--cells all|gpu]

Each notebook runs in a fresh kernel (the current Python), from the notebooks folder, with the environment
as given (gpu_check.sh sets MINFER_IMPL=solutions and MINFER_GPU_FIGURES=OUT_DIR/gpu). The executed copy goes
to OUT_DIR/notebooks/ (the course notebooks, whose stored outputs are the CPU run nbval checks, are never
written), its figures to OUT_DIR/figures/<notebook>_<cell>.png, and one row per notebook (status, seconds,
the cells that ran and each one's seconds, the cell that failed or ran out of time) to OUT_DIR/summary.md and
summary.json, rewritten after every notebook so that a run killed midway still leaves the rows it finished.

--cells all (the default) runs every cell. --cells gpu runs, in each notebook, only its GPU cells (the cells
that call `gpu_cell(...)`, minfer.lab.bench.gpu_figures) and the cells they need (minfer.lab.bench.notebook_cells:
the first code cell, and every cell that last defined a name a needed cell reads, transitively), in notebook
order. In its executed copy the cells that did not run have no outputs and no execution count (their saved
outputs are cleared, so that the copy and its figures show only what this run computed); a notebook without
a GPU cell is not run at all and gets the status "no gpu cell".

Statuses: ok, no gpu cell, error (a cell raised, the kernel died, or anything else went wrong with the
notebook, such as a kernel that would not start: the row says what), timeout (the notebook's budget ran
out), skipped (the total budget ran out before it). Exits 1 unless every notebook is ok or has no GPU cell.
"""
from __future__ import annotations

import argparse
import base64
import json
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # minfer from this checkout (as gpu_check.sh sets)
from minfer.lab.bench.notebook_cells import cells_calling, code_cells, needed_cells  # noqa: E402

GPU_CALLS = {"gpu_cell"}  # what makes a cell a GPU cell
PASSING = ("ok", "no gpu cell")


def cells_to_run(nb, which: str) -> list[int]:
    """The indices of the cells to execute, in order: every cell, or the GPU cells and the cells they need."""
    if which == "all":
        return list(range(len(nb.cells)))
    return needed_cells(nb.cells, cells_calling(nb.cells, GPU_CALLS))


def run_notebook(path: Path, out: Path, budget_s: float, which: str = "all") -> dict:
    """Execute one notebook's cells (all, or its GPU cells and what they need) until its budget is spent;
    write the executed copy and its figures. Never raises for a notebook's own failures: they become the row."""
    row = {"notebook": path.name, "status": "ok", "seconds": 0.0, "cell": None, "error": "", "figures": 0,
           "cells": None, "cell_seconds": {}}
    start = time.monotonic()
    nb = None
    try:
        nb = nbformat.read(path, as_version=4)
        run = cells_to_run(nb, which)
        row["cells"] = "all" if which == "all" else run
        if not run:
            row.update(status="no gpu cell")
            return row
        if which != "all":
            for index in set(code_cells(nb.cells)) - set(run):  # what shows is what this run computed
                nb.cells[index].outputs, nb.cells[index].execution_count = [], None
        client = NotebookClient(nb, timeout=int(budget_s), kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent.resolve())}})
        with client.setup_kernel():
            for index in run:
                left = budget_s - (time.monotonic() - start)
                if left <= 0:
                    raise CellTimeoutError(f"the notebook's budget of {budget_s:.0f} s ran out before cell {index}")
                client.timeout = max(1, int(left))
                row["cell"] = index
                began = time.monotonic()
                try:
                    client.execute_cell(nb.cells[index], index)
                finally:
                    if nb.cells[index].cell_type == "code":
                        row["cell_seconds"][index] = round(time.monotonic() - began, 1)
        row["cell"] = None
    except CellTimeoutError as exc:
        row.update(status="timeout", error=str(exc).splitlines()[0][:200])
    except (CellExecutionError, DeadKernelError) as exc:
        lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
        row.update(status="error", error=(lines[-1] if lines else type(exc).__name__)[:200])
    except Exception as exc:  # a kernel that would not start, an unreadable notebook, ...: this notebook's error
        row.update(status="error", error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
    finally:
        row["seconds"] = round(time.monotonic() - start, 1)
    if nb is not None:
        try:
            (out / "notebooks").mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, out / "notebooks" / path.name)
            row["figures"] = save_figures(nb, path.stem, out / "figures")
        except Exception as exc:  # (keep the row's own error, if it has one)
            if row["status"] in PASSING:
                row.update(status="error", cell=None, error=f"writing the results: {type(exc).__name__}: {exc}"[:200])
    return row


def save_figures(nb, stem: str, folder: Path) -> int:
    count = 0
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                folder.mkdir(parents=True, exist_ok=True)
                count += 1
                (folder / f"{stem}_cell{index:02d}_{count}.png").write_bytes(base64.b64decode(png))
    return count


def format_cells(row: dict) -> str:
    """Which cells ran: "all", or "1, 2, 18"; with a failure, the cells after the failing one did not run."""
    cells = row.get("cells")
    if cells is None or cells == "all":
        return cells or ""
    return ", ".join(map(str, cells)) or "none"


def format_summary(rows: list[dict]) -> str:
    lines = ["| notebook | status | seconds | figures | cells run | where / error |", "|---|---|---:|---:|---|---|"]
    for r in rows:
        where = f"cell {r['cell']}: {r['error']}" if r["status"] not in PASSING else ""
        lines.append(f"| {r['notebook']} | {r['status']} | {r['seconds']:.0f} | {r['figures']} | {format_cells(r)} "
                     f"| {where.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_summary(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(format_summary(rows))
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("notebooks", type=Path, nargs="+")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds per notebook")
    parser.add_argument("--total", type=float, default=480.0, help="seconds for all of them")
    parser.add_argument("--cells", choices=("all", "gpu"), default="all",
                        help="all: every cell; gpu: the GPU cells and the cells they need")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {missing}")
    start, rows = time.monotonic(), []
    for path in args.notebooks:
        left = args.total - (time.monotonic() - start)
        if left < 5:
            rows.append({"notebook": path.name, "status": "skipped", "seconds": 0.0, "cell": None, "figures": 0,
                         "cells": None, "cell_seconds": {}, "error": "the total budget ran out"})
        else:
            rows.append(run_notebook(path, args.out, min(args.budget, left), args.cells))
            r = rows[-1]
            ran = f" (cells {format_cells(r)})" if args.cells != "all" and r["cells"] else ""
            print(f"{path.name}: {r['status']} in {r['seconds']:.0f} s{ran} {r['error']}", flush=True)
        write_summary(rows, args.out)
    write_summary(rows, args.out)
    return 0 if all(r["status"] in PASSING for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
