"""The course's prose as a learner reads it: no mangled characters, balanced math, no dangling references.

A backslash lost between a Python string and a notebook turns `\\times` into a TAB and `\\frac` into a form feed:
the formula renders as garbage and no cell fails. These checks read the files; nothing is executed.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOCUMENTS = [ROOT / "README.md", ROOT / "notebooks" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.md"))]
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # below a space, but for newline and TAB (checked outside code)
CODE_SPAN = re.compile(r"```.*?```|`[^`\n]*`", re.S)
REPO_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|sh|ipynb|png|cfg|toml|yml))`")
LINK = re.compile(r"\]\(([^)#\s]+)")
# Written by a GPU run (benchmarks/gpu_check.sh), or placeholders in a command's description: not in the repo.
NOT_IN_REPO = re.compile(r"docs/gpu/|OUT_DIR/|\.model_parts/")


def markdown_cells(path: Path) -> list[tuple[int, str]]:
    cells = json.loads(path.read_text())["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "markdown"]


def texts() -> list[tuple[str, Path, str]]:
    """(where, folder that relative links start from, text) for every markdown cell and document."""
    found = [(f"{nb.name} cell {i}", nb.parent, text) for nb in NOTEBOOKS for i, text in markdown_cells(nb)]
    return found + [(str(doc.relative_to(ROOT)), doc.parent, doc.read_text()) for doc in DOCUMENTS]


TEXTS = texts()


@pytest.mark.parametrize("where, folder, text", TEXTS, ids=[where for where, _, _ in TEXTS])
def test_prose(where: str, folder: Path, text: str) -> None:
    control = [(m.start(), repr(text[max(0, m.start() - 20):m.start() + 20])) for m in CONTROL.finditer(text)]
    assert not control, f"{where}: control characters (a lost backslash?) at {control[:3]}"
    prose = CODE_SPAN.sub("", text)
    assert "\t" not in prose, f"{where}: a TAB in the prose (a lost backslash before t?)"
    if ".ipynb" in where:  # notebooks render $...$ as math: an odd count swallows the rest of the cell
        assert prose.count("$$") % 2 == 0, f"{where}: unbalanced $$"
        assert prose.replace("$$", "").count("$") % 2 == 0, f"{where}: unbalanced $"
    for cited in REPO_PATH.findall(text):
        if not NOT_IN_REPO.match(cited):
            assert (ROOT / cited).exists() or (folder / cited).exists(), f"{where} cites {cited}, which does not exist"
    for target in LINK.findall(prose):
        if not re.match(r"[a-z]+:", target):
            assert (folder / target).exists(), f"{where} links to {target}, which does not exist"


@pytest.mark.parametrize("text, complaint", [
    ("$$a \times b \frac{1}{2}$$", "control characters"),  # "\\times" written without escaping its backslash
    ("costs $O(n)$ or $O(n^2) per token", "unbalanced \\$"),
    ("see `minfer/no_such_file.py`", "does not exist"),
    ("see [the guide](no_such_guide.md)", "does not exist"),
])
def test_the_checks_catch(text: str, complaint: str) -> None:
    with pytest.raises(AssertionError, match=complaint):
        test_prose("00_measure.ipynb cell 0", ROOT / "notebooks", text)


def recorded_run_seconds(path: Path) -> float:
    """The sum of the code cells' run times in the notebook's execution metadata (as nbclient records them)."""
    from minfer.bench.notebook_cells import recorded_seconds

    times = [recorded_seconds(c) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert all(t is not None for t in times), f"{path.name}: a code cell without its execution times (re-execute it)"
    return sum(times)


def seconds(amount: str, unit: str) -> float:
    return float(amount) * (60 if unit.startswith("min") else 1)


def close_enough(stated: float, recorded: float) -> bool:
    """A stated time is a rounded figure: within a third, or within 15 s for short runs."""
    return abs(stated - recorded) <= max(15.0, recorded / 3)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_stated_run_times_match_the_saved_run(notebook: Path) -> None:
    """Each chapter's opening and the course map state how long its cells ran: the saved run's own times."""
    recorded = recorded_run_seconds(notebook)
    opening = markdown_cells(notebook)[0][1]
    stated = re.search(r"about ([\d.]+) (s|min)\w* for the cells to run", opening)
    assert stated, f"{notebook.name}: the first cell does not say 'about N s|min for the cells to run'"
    assert close_enough(seconds(*stated.groups()), recorded), \
        f"{notebook.name} says {stated.group(0)!r}; the saved run took {recorded:.0f} s"
    row = re.search(rf"\[[^\]]+\]\({re.escape(notebook.name)}\)(?:[^|\n]*\|){{4}}\s*([\d.]+) (s|min)\s*\|",
                    (ROOT / "notebooks" / "README.md").read_text())
    assert row, f"notebooks/README.md has no 'cells run' entry for {notebook.name}"
    assert close_enough(seconds(*row.groups()), recorded), \
        f"notebooks/README.md says {notebook.name} cells run {row.group(1)} {row.group(2)}; the saved run took {recorded:.0f} s"
