"""The course's prose as a learner reads it: no mangled characters, balanced math, no dangling references, and no
words about how the course was made.

A backslash lost between a Python string and a notebook turns `\\times` into a TAB and `\\frac` into a form feed:
the formula renders as garbage and no cell fails. These checks read the files; nothing is executed.
"""
import io
import json
import re
import tokenize
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


# Words about how the course was made rather than about what the learner sees: tracker issues, commits, the machines
# it was built on and their limits, runs the learner never sees. Each rule: (what it finds, pattern).
MAKING_OF = [
    # "(issue 11)", "issue #3", "Issue 16's run"; not the verb ("the client issues 8 requests", "issue 4 requests")
    ("an issue number", re.compile(r"\(issues?\b|\bissues?\s+#\d+|\bissue\s+\d+(?!\s+[a-z])", re.I)),
    # "measured at commit 6262a2e", "commit hash 1f3e...": 7 to 40 hex digits (one a digit) near the word; or a
    # bare 40-digit hash
    ("a commit hash", re.compile(r"\bcommit(?:s|ted)?\b(?:\W+\w+){0,2}?\W+(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
                                 r"|(?<![0-9a-f])[0-9a-f]{40}(?![0-9a-f])", re.I)),
    ("a limit of the machines the course was built on",
     re.compile(r"\d+\s*MiB per call|\bdevice time\b|\bminutes of (?:device|GPU) time\b|\bfiles? come back\b", re.I)),
    ("a run the learner never sees", re.compile(r"\bour (?:earlier|previous|last|first|own) runs?\b|\bthe next GPU run\b"
                                                r"|\bits own target\b|\bwhile building this\b", re.I)),
    # a lab log: "0.95 in an earlier run", "The run before, on 2026-11-30", "Measured again on 2026-12-04"
    ("a lab log", re.compile(r"\b(?:an|the) (?:earlier|previous) run\b|\bthe run before\b|\bthe (?:last|first) GPU run\b"
                             r"|\bmeasured again on \d", re.I)),
]
# A folder on the machine that ran the notebook, anywhere (source, prose, outputs); /tmp/ only in prose, since a cell
# may print the path of a temporary file of its own.
MACHINE_PATH = ("a path on one machine", re.compile(r"(?<![\w.~$-])/(?:work|root|home)/"))
TMP_PATH = ("a temporary folder of one machine", re.compile(r"(?<![\w.~$-])/tmp/"))


def making_of_hits(text: str, prose: bool, first_line: int = 1) -> list[str]:
    """What in `text` speaks of how the course was made: 'line N: what it finds: the words' for each hit."""
    rules = [*MAKING_OF, MACHINE_PATH, *([TMP_PATH] if prose else [])]
    return [f"line {first_line + text.count(chr(10), 0, m.start())}: {what}: {m.group(0)!r}"
            for what, pattern in rules for m in pattern.finditer(text)]


def notebook_parts(path: Path) -> list[tuple[str, str, bool, int]]:
    """(where, text, whether it is prose, its first line) for each cell's source and each of its text outputs."""
    parts = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        parts.append((f"cell {i} ({cell['cell_type']}) ", "".join(cell["source"]), cell["cell_type"] == "markdown", 1))
        for output in cell.get("outputs", []):
            texts = [output.get("text", "")] + [v for k, v in output.get("data", {}).items() if k.startswith("text/")]
            parts += [(f"cell {i} (output) ", "".join(text), False, 1) for text in texts]
    return parts


def python_strings(path: Path) -> list[tuple[str, str, bool, int]]:
    """('', text, False, its line) for each string literal (docstrings and messages included) and comment of a module."""
    kinds = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [("", token.string, False, token.start[0]) for token in tokens if token.type in kinds]


PRODUCT = [*NOTEBOOKS, *DOCUMENTS, *sorted((ROOT / "minfer").rglob("*.py"))]


@pytest.mark.parametrize("path", PRODUCT, ids=[str(p.relative_to(ROOT)) for p in PRODUCT])
def test_no_words_about_the_making(path: Path) -> None:
    """The course speaks to its learners: no issue numbers, commits, build machines and their limits, or unseen runs."""
    name = str(path.relative_to(ROOT))
    parts = (notebook_parts(path) if path.suffix == ".ipynb" else python_strings(path) if path.suffix == ".py"
             else [("", path.read_text(), True, 1)])
    hits = [where + hit for where, text, prose, line in parts for hit in making_of_hits(text, prose, line)]
    assert not hits, f"{name} speaks of how the course was made:\n" + "\n".join(hits[:10])


@pytest.mark.parametrize("text, prose, caught", [
    ("as the lead asked (issue 11), the rate", True, True),
    ("Issue 16's GPU run measured", True, True),
    ("see issue #7", True, True),
    ("measured at commit 6262a2e", True, True),
    ("the commit hash is 0123456789abcdef0123456789abcdef01234567", True, True),
    ("a machine that only takes 64 MiB per call", True, True),
    ("the session's 15 minutes of device time", True, True),
    ("in our earlier runs on such a machine", True, True),
    ("the next GPU run measures them", True, True),
    ("4.9x, short of its own target", True, True),
    ("1.11 (noise; 0.95 in an earlier run)", True, True),
    ("The run before, on 2026-11-30, used", True, True),
    ("it shows the figures of the last GPU run", True, True),
    ("**Measured again on 2026-12-04**", True, True),
    ("the checkpoint: /root/.cache/minfer/model", False, True),
    ("cd /work/main && make test", False, True),
    ("benchmarks/gpu_check.sh /tmp/gpu_rehearsal", True, True),
    # and what it must let through
    ("the client issues 8 requests; we issue 4 requests at once", True, False),
    ("interactive sessions and notebooks", True, False),
    ("a server's bound on work per call", True, False),
    ("the tokens committed so far", True, False),
    ("the trace goes to /tmp/tmpab12cd/trace.json", False, False),  # a cell's own temporary file, in its output
    ("the checkpoint: ~/.cache/minfer/model", False, False),
    ("the device's time per step, and the host's", True, False),
    ("int4 g64, measured again on the scrambled model", True, False),
    ("the stored GPU figures, with the device and the date", True, False),
])
def test_the_making_of_check_catches(text: str, prose: bool, caught: bool) -> None:
    assert bool(making_of_hits(text, prose)) == caught, making_of_hits(text, prose)


def recorded_run_seconds(path: Path) -> float:
    """The sum of the code cells' run times in the notebook's execution metadata (as nbclient records them)."""
    from minfer.lab.bench.notebook_cells import recorded_seconds

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
