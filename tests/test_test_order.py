"""The suite's files run longest first (tests/conftest.py, from tests/durations.json), so that neither test
process is left idle at the end while the other runs a long file."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def collected_files(*paths: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *paths], cwd=ROOT,
                         capture_output=True, text=True, timeout=300).stdout
    files = [line.split("::")[0] for line in out.splitlines() if "::" in line]
    return list(dict.fromkeys(files))


def test_longest_recorded_file_is_collected_first_whatever_the_order_given():
    recorded = json.loads((ROOT / "tests" / "durations.json").read_text())
    short, long = "tests/test_packaging.py", "tests/test_kernel_compile.py"
    assert recorded[long] > 10 * recorded[short]
    assert collected_files(short, long) == [long, short]
    assert collected_files(long, short) == [long, short]


def test_every_recorded_file_exists():
    """A renamed or deleted file would keep a stale entry: rewrite the file with --record-durations."""
    recorded = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert [f for f in recorded if not (ROOT / f).exists()] == []
