"""Every notebook opens with the set-up cell: on Google Colab it installs the course from the repository that
pyproject.toml names, then calls `minfer.lab.course.setup_notebook()`; elsewhere it prints one line.

The cell comes right after the chapter's opening text, before the imports, and its first lines are plain Python:
on a fresh Colab runtime there is no minfer to import until the cell has installed it.
"""
import json
import re
from pathlib import Path

import pytest

from minfer.lab.course import setup_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
REPOSITORY = re.search(r'^Repository = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)  # [project.urls]


def setup_cell(notebook: Path) -> dict:
    return json.loads(notebook.read_text())["cells"][1]


def is_setup_cell(cell: dict) -> bool:
    return cell["cell_type"] == "code" and "setup_notebook()" in "".join(cell["source"])


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_the_setup_cell_opens_every_notebook(notebook: Path) -> None:
    cell = setup_cell(notebook)
    assert is_setup_cell(cell), f"{notebook.name}: cell 1 (after the opening text) is not the set-up cell"
    source = "".join(cell["source"])
    first_import = re.search(r"^(?:from|import) minfer", source, re.M)
    assert first_import and source.index('"google.colab" in sys.modules') < first_import.start(), \
        "the Colab install must come before the first import of minfer"
    assert f'"{REPOSITORY}"' in source, f"{notebook.name}: the set-up cell does not clone {REPOSITORY} (pyproject.toml)"
    assert "".join(cell["outputs"][0]["text"]).count("\n") == 1, "the set-up cell prints one line"


def test_the_setup_cell_is_the_same_everywhere() -> None:
    sources = {"".join(setup_cell(nb)["source"]) for nb in NOTEBOOKS}
    assert len(sources) == 1, "the notebooks' set-up cells differ"


def test_the_readme_names_the_repository() -> None:
    assert REPOSITORY in (ROOT / "README.md").read_text()


def test_setup_notebook_prints_one_line_and_stays_put_off_colab(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    setup_notebook()
    assert capsys.readouterr().out == "minfer on the CPU: dtype='auto' is torch.float32\n"
    assert Path.cwd() == tmp_path


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_every_cell_has_a_unique_id(notebook: Path) -> None:
    """nbformat 4.5 wants an id on every cell; without one the notebook does not validate, JupyterLab cannot trust it,
    and its saved widgets show as text."""
    cells = json.loads(notebook.read_text())["cells"]
    ids = [cell.get("id") for cell in cells]
    assert None not in ids and len(set(ids)) == len(ids), f"{notebook.name}: cells without an id or with the same one"
