"""A chapter's GPU figures: measured on CUDA, stored as docs/gpu/<chapter>.json, shown everywhere else.

Every chapter's GPU cell is one call, `gpu_cell(chapter, title, measure, folder)`:

* on a CUDA machine (or in a rehearsal, `MINFER_GPU_REHEARSE=1`) it runs `measure()`, which returns
  the figures as columns (`{"batch": [1, 64], "tokens/s": [310.0, 9100.0]}`), stores them with the
  device's name and the date (`save_figures`) and shows them;
* elsewhere it shows the stored GPU figures (`load_figures`, `show_figures`),
  labelled with the device and the date, or says that none are stored yet.

`benchmarks/gpu_check.sh` runs the notebooks on a GPU with `MINFER_GPU_FIGURES` pointing at its
output folder, so the JSON files land there and are then copied to docs/gpu/. As everywhere in
minfer.lab.bench, the folder is passed in (a notebook passes "../docs/gpu"), never derived from here.
"""
from __future__ import annotations

import io
import json
import math
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Union

import torch

FOLDER_ENV = "MINFER_GPU_FIGURES"  # overrides the folder figures are read from and written to
REHEARSE_ENV = "MINFER_GPU_REHEARSE"  # "1": measure on this CPU too (gpu_check.sh with DEVICE=cpu)
REQUIRED_KEYS = ("chapter", "title", "device", "date", "columns")


def measuring_here() -> bool:
    """True where a GPU cell measures: a CUDA device is present, or a CPU rehearsal was asked for."""
    return torch.cuda.is_available() or os.environ.get(REHEARSE_ENV) == "1"


def device_name() -> str:
    """The GPU's name (e.g. 'NVIDIA H200'), else the CPU's."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def figures_path(chapter: str, folder: Union[str, Path]) -> Path:
    return Path(os.environ.get(FOLDER_ENV) or folder) / f"{chapter}.json"


def make_figures(chapter: str, title: str, columns: dict[str, list], notes: str = "",
                 plot: Optional[dict] = None) -> dict:
    """The stored form: columns of equal length, labelled with this device, the date and torch's version.

    plot (optional): {"x": column, "y": [columns], "logx": bool, "ylabel": str} draws them when shown."""
    lengths = {name: len(values) for name, values in columns.items()}
    if not columns or len(set(lengths.values())) != 1:
        raise ValueError(f"columns must be a non-empty dict of equally long lists, got lengths {lengths}")
    if plot is not None:
        missing = [c for c in [plot.get("x"), *plot.get("y", [])] if c not in columns]
        if missing or not plot.get("y"):
            raise ValueError(f"plot needs 'x' and 'y' naming columns among {list(columns)}, missing {missing}")
    return {"chapter": chapter, "title": title, "device": device_name(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "torch": torch.__version__,
            "columns": {name: list(values) for name, values in columns.items()}, "notes": notes, "plot": plot}


def save_figures(figures: dict, folder: Union[str, Path]) -> Path:
    path = figures_path(figures["chapter"], folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1) + "\n")
    return path


def load_figures(chapter: str, folder: Union[str, Path]) -> Optional[dict]:
    """The stored figures of a chapter, or None if none are stored; a malformed file raises ValueError."""
    path = figures_path(chapter, folder)
    if not path.is_file():
        return None
    figures = json.loads(path.read_text())
    missing = [key for key in REQUIRED_KEYS if key not in figures]
    if missing:
        raise ValueError(f"{path} lacks {missing}: write it with minfer.lab.bench.gpu_figures.save_figures")
    return figures


def _cell(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def format_figures(figures: dict) -> str:
    """A text table headed by what was measured, on which device, when."""
    names = list(figures["columns"])
    rows = [[_cell(v) for v in row] for row in zip(*figures["columns"].values())]
    widths = [max(len(name), *(len(row[i]) for row in rows)) for i, name in enumerate(names)]
    lines = [f"{figures['title']}: measured on {figures['device']}, {figures['date']} (torch {figures.get('torch', '?')})",
             "  ".join(name.rjust(w) for name, w in zip(names, widths))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    if figures.get("notes"):
        lines.append(figures["notes"])
    return "\n".join(lines)


def plot_figures(figures: dict):
    """A matplotlib Figure of the columns that `plot` names (drawn without pyplot: the inline backend stays)."""
    from matplotlib.figure import Figure

    spec, columns = figures["plot"], figures["columns"]
    fig = Figure(figsize=(6.5, 3.2))
    ax = fig.add_subplot()
    for name in spec["y"]:
        ax.plot(columns[spec["x"]], columns[name], marker="o", label=name)
    if spec.get("logx"):
        ax.set_xscale("log", base=2)
    ax.set_xlabel(spec["x"])
    ax.set_ylabel(spec.get("ylabel", ""))
    ax.set_title(f"{figures['device']}, {figures['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def show_figures(chapter: str, folder: Union[str, Path], figures: Optional[dict] = None) -> Optional[dict]:
    """Print (and plot, where the figures say how) a chapter's GPU figures, or say that none are stored."""
    figures = figures or load_figures(chapter, folder)
    if figures is None:
        print(f"No GPU figures stored for {chapter} yet ({figures_path(chapter, folder)}): "
              "run benchmarks/gpu_check.sh on a CUDA machine (docs/gpu.md).")
        return None
    print(format_figures(figures))
    if figures.get("plot"):
        from IPython.display import Image, display

        # as a PNG, not the Figure: a kernel shows a Figure as an image only once pyplot has set up its inline
        # backend, which a GPU cell run without the cells before it (run_notebooks.py --cells gpu) may not have
        display(Image(data=figure_png(plot_figures(figures))))
    return figures


def figure_png(fig, dpi: int = 100) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, bbox_inches="tight")
    return buffer.getvalue()


def gpu_cell(chapter: str, title: str, measure: Callable[[], dict[str, list]], folder: Union[str, Path],
             notes: str = "", plot: Optional[dict] = None, needs_cuda: bool = False) -> Optional[dict]:
    """Measure and store on CUDA (or in a rehearsal, unless needs_cuda), else show the stored figures.

    Returns the figures shown (None when none are stored)."""
    if not measuring_here() or (needs_cuda and not torch.cuda.is_available()):
        return show_figures(chapter, folder)
    figures = make_figures(chapter, title, measure(), notes=notes, plot=plot)
    print("stored in", save_figures(figures, folder))
    return show_figures(chapter, folder, figures)
