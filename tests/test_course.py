"""minfer.lab.course reads what a chapter's tests recorded (a kernel's measured speedup on CUDA) from pytest's report."""
import subprocess
import sys

from minfer.lab.course import _parse_junit, why_no_report


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


def test_a_crashed_test_process_is_reported_as_a_crash(tmp_path):
    """A kernel that reads outside a tensor can kill the test process: check() must say so and show where,
    not that pytest 'did not run'."""
    (tmp_path / "test_crash.py").write_text("import ctypes\n\ndef test_reads_address_zero():\n    ctypes.string_at(0)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_crash.py"],
                          cwd=tmp_path, capture_output=True, text=True)
    message = why_no_report(proc)
    assert message.startswith("the test process crashed (SIGSEGV)"), message
    assert "test_crash.py" in message and "test_reads_address_zero" in message, message
    killed = subprocess.CompletedProcess([], -9, "", "...\nlast words")  # the out-of-memory killer, say
    assert why_no_report(killed) == "the test process was killed by SIGKILL; the end of its output:\n...\nlast words"
    usage = subprocess.run([sys.executable, "-m", "pytest", "--no-such-option"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert why_no_report(usage).startswith("pytest did not run") and "no-such-option" in why_no_report(usage)
