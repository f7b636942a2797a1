"""environment.yml (conda) and pyproject.toml (pip) must list the same packages."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def names(requirements):
    return {re.split(r"[<>=!~\[ ;]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def test_environment_yml_matches_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pip_lines = re.findall(r"^\s+- (\S[^#\n]*)", (ROOT / "environment.yml").read_text().split("- pip:")[1], re.M)
    conda_pip = [line for line in pip_lines if not line.startswith("-e")]
    assert names(conda_pip) == names(pyproject)


def test_makefile_pins_a_cpu_torch_by_default():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_SPEC \?= torch==\d", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
