"""minfer.course reads what a chapter's tests recorded (a kernel's measured speedup on CUDA) from pytest's report."""
import subprocess
import sys

from minfer.course import _parse_junit


def test_recorded_properties_and_outcomes_come_back(tmp_path):
    (tmp_path / "test_recorded.py").write_text(
        "def test_fast(record_property):\n    record_property('speedup over the reference', '3.2x')\n\n"
        "def test_broken():\n    raise NotImplementedError('write me')\n")
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_recorded.py",
                    f"--junitxml={report}", "-o", "junit_family=xunit1"], cwd=tmp_path, capture_output=True)
    results = {r.name: r for r in _parse_junit(str(report))}
    assert results["test_fast"].outcome == "passed"
    assert results["test_fast"].properties == {"speedup over the reference": "3.2x"}
    assert results["test_broken"].outcome == "failed" and "write me" in results["test_broken"].message
    assert results["test_broken"].properties == {}
