"""The notebooks' GPU cells: figures stored with device and date, shown on CPU, measured in a rehearsal."""
import json

import pytest

from minfer.lab.bench import gpu_figures as gf


def test_gpu_cell_on_cpu_shows_that_none_are_stored_and_does_not_measure(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(gf.REHEARSE_ENV, raising=False)
    monkeypatch.delenv(gf.FOLDER_ENV, raising=False)
    if gf.measuring_here():
        pytest.skip("a CUDA device is present: the cell measures")
    assert gf.gpu_cell("ch99", "t", lambda: pytest.fail("measured on the CPU"), tmp_path) is None
    assert "No GPU figures stored for ch99 yet" in capsys.readouterr().out


def test_rehearsal_measures_stores_and_the_next_cpu_run_shows_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(gf.REHEARSE_ENV, "1")
    monkeypatch.setenv(gf.FOLDER_ENV, str(tmp_path / "out"))  # the env var wins over the folder passed in
    shown = gf.gpu_cell("ch99", "decode rate", lambda: {"batch": [1, 64], "tokens/s": [310.123456, 9100.0]},
                        tmp_path / "unused", notes="a note", plot={"x": "batch", "y": ["tokens/s"], "logx": True})
    stored = json.loads((tmp_path / "out" / "ch99.json").read_text())
    assert stored == shown and stored["columns"]["batch"] == [1, 64] and stored["device"] == gf.device_name()
    assert not (tmp_path / "unused").exists()
    monkeypatch.setenv(gf.REHEARSE_ENV, "0")
    capsys.readouterr()
    if not gf.measuring_here():
        assert gf.gpu_cell("ch99", "decode rate", lambda: pytest.fail("measured"), tmp_path / "unused") == stored
    text = gf.format_figures(stored)
    assert text.splitlines()[0].startswith(f"decode rate: measured on {stored['device']}, {stored['date']}")
    assert "310.1" in text and "310.12" not in text and text.endswith("a note")
    assert gf.plot_figures(stored).axes[0].get_xscale() == "log"


def test_bad_figures_are_refused(tmp_path):
    with pytest.raises(ValueError, match="equally long"):
        gf.make_figures("ch99", "t", {"a": [1, 2], "b": [1]})
    with pytest.raises(ValueError, match="plot needs"):
        gf.make_figures("ch99", "t", {"a": [1]}, plot={"x": "a", "y": ["nope"]})
    (tmp_path / "ch99.json").write_text(json.dumps({"chapter": "ch99"}))
    with pytest.raises(ValueError, match="lacks"):
        gf.load_figures("ch99", tmp_path)


def test_a_plot_is_shown_as_a_png_whatever_the_kernel_has_set_up(tmp_path, monkeypatch, capsys):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    figures = gf.make_figures("ch99", "t", {"batch": [1, 2], "tokens/s": [3.0, 4.0]}, plot={"x": "batch", "y": ["tokens/s"]})
    gf.show_figures("ch99", tmp_path, figures)
    assert len(shown) == 1 and isinstance(shown[0], IPython.display.Image)
    assert shown[0].data.startswith(b"\x89PNG") and shown[0]._repr_png_()
    gf.show_figures("ch99", tmp_path, dict(figures, plot=None))
    assert len(shown) == 1  # no plot asked for, none shown


# Chapters whose GPU cell is written but has not yet run on a GPU (benchmarks/gpu_check.sh runs it): their cell says
# so on a CPU. An entry must go once its figures are stored.
AWAITING_A_GPU_RUN = {"ch12"}


def test_every_gpu_cell_has_stored_figures_from_a_gpu():
    """Each chapter whose notebook has a GPU cell has figures in docs/gpu/ that were measured on CUDA, name the
    device and date, and render (what a learner on a CPU sees in that cell)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    chapters = {f"ch{nb.name[:2]}" for nb in (root / "notebooks").glob("[0-9]*.ipynb")
                if "gpu_cell(" in nb.read_text()}
    assert len(chapters) >= 9, chapters
    assert AWAITING_A_GPU_RUN <= chapters
    for chapter in sorted(chapters):
        figures = gf.load_figures(chapter, root / "docs" / "gpu")
        if chapter in AWAITING_A_GPU_RUN:
            assert figures is None, f"{chapter} has GPU figures now: take it off AWAITING_A_GPU_RUN"
            continue
        assert figures is not None, f"{chapter}: no docs/gpu/{chapter}.json"
        assert figures["chapter"] == chapter and figures["device"] not in ("", "cpu") and figures["date"]
        assert "+cu" in figures["torch"], figures["torch"]  # a CUDA build of torch measured them
        text = gf.format_figures(figures)
        assert text.startswith(f"{figures['title']}: measured on {figures['device']}")
        if figures.get("plot"):
            assert gf.plot_figures(figures).axes[0].lines
