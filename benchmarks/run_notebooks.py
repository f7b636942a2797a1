"""Execute course notebooks into an output folder, each within a time budget (benchmarks/gpu_check.sh).

    python benchmarks/run_notebooks.py OUT_DIR notebooks/00_measure.ipynb ... [--budget 150] [--total 480]

Each notebook runs in a fresh kernel (the current Python), from the notebooks folder, with the environment
as given (gpu_check.sh sets MINFER_IMPL=solutions and MINFER_GPU_FIGURES=OUT_DIR/gpu). The executed copy goes
to OUT_DIR/notebooks/ (the course notebooks, whose stored outputs are the CPU run nbval checks, are never
written), its figures to OUT_DIR/figures/<notebook>_<cell>.png, and one row per notebook (status, seconds,
the cell that failed or ran out of time) to OUT_DIR/summary.md and summary.json. Exits 1 if any notebook
did not finish.
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


def run_notebook(path: Path, out: Path, budget_s: float) -> dict:
    """Execute one notebook cell by cell until its budget is spent; write the executed copy and its figures."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=int(budget_s), kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    row = {"notebook": path.name, "status": "ok", "seconds": 0.0, "cell": None, "error": ""}
    start = time.monotonic()
    try:
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                left = budget_s - (time.monotonic() - start)
                if left <= 0:
                    raise CellTimeoutError(f"the notebook's budget of {budget_s:.0f} s ran out before cell {index}")
                client.timeout = max(1, int(left))
                row["cell"] = index
                client.execute_cell(cell, index)
        row["cell"] = None
    except CellTimeoutError as exc:
        row.update(status="timeout", error=str(exc).splitlines()[0][:200])
    except (CellExecutionError, DeadKernelError) as exc:
        lines = [line for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
        row.update(status="error", error=(lines[-1] if lines else type(exc).__name__)[:200])
    row["seconds"] = round(time.monotonic() - start, 1)
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / "notebooks" / path.name)
    row["figures"] = save_figures(nb, path.stem, out / "figures")
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


def format_summary(rows: list[dict]) -> str:
    lines = ["| notebook | status | seconds | figures | where / error |", "|---|---|---:|---:|---|"]
    for r in rows:
        where = f"cell {r['cell']}: {r['error']}" if r["status"] != "ok" else ""
        lines.append(f"| {r['notebook']} | {r['status']} | {r['seconds']:.0f} | {r['figures']} | {where.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("notebooks", type=Path, nargs="+")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds per notebook")
    parser.add_argument("--total", type=float, default=480.0, help="seconds for all of them")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {missing}")
    start, rows = time.monotonic(), []
    for path in args.notebooks:
        left = args.total - (time.monotonic() - start)
        if left < 5:
            rows.append({"notebook": path.name, "status": "skipped", "seconds": 0.0, "cell": None, "figures": 0,
                         "error": "the total budget ran out"})
            continue
        rows.append(run_notebook(path, args.out, min(args.budget, left)))
        print(f"{path.name}: {rows[-1]['status']} in {rows[-1]['seconds']:.0f} s {rows[-1]['error']}", flush=True)
    summary = format_summary(rows)
    (args.out / "summary.md").write_text(summary)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
