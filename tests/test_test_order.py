"""The suite's files run longest first (tests/conftest.py, from tests/durations.json), so that neither test
process is left idle at the end while the other runs a long file."""
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# by path: `import conftest` may find tests/exercises/conftest.py, which pytest also imports as "conftest"
_spec = importlib.util.spec_from_file_location("minfer_tests_conftest", ROOT / "tests" / "conftest.py")
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)
DURATIONS, pytest_collection_modifyitems = conftest.DURATIONS, conftest.pytest_collection_modifyitems


def ordered_files(*nodeids: str) -> list[str]:
    items = [SimpleNamespace(nodeid=n) for n in nodeids]
    pytest_collection_modifyitems(config=None, items=items)
    return list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))


def test_longest_recorded_file_runs_first_whatever_the_order_collected():
    recorded = json.loads(DURATIONS.read_text())
    short, long = "tests/test_packaging.py", "tests/test_kernel_compile.py"
    assert recorded[long] > 10 * recorded[short]
    tests = [f"{short}::a", f"{short}::b", f"{long}::a", f"{long}::b"]
    assert ordered_files(*tests) == [long, short]
    assert ordered_files(*reversed(tests)) == [long, short]


def test_a_file_not_recorded_counts_one_second_a_test_and_keeps_its_tests_in_order():
    new = [f"tests/new_{i // 3}.py::t{i}" for i in range(6)]  # two files of three tests: 3 s each
    items = [SimpleNamespace(nodeid=n) for n in ["tests/test_packaging.py::x"] + new]  # recorded: well under 3 s
    pytest_collection_modifyitems(config=None, items=items)
    assert [i.nodeid for i in items] == new + ["tests/test_packaging.py::x"]


def test_every_recorded_file_exists():
    """A renamed or deleted file would keep a stale entry: rewrite the file with --record-durations."""
    recorded = json.loads(DURATIONS.read_text())
    assert [f for f in recorded if not (ROOT / f).exists()] == []
