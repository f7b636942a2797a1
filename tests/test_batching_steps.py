"""benchmarks/batching_steps.py: the step counts that explain chapter 04's GPU figures."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "batching_steps.py"


def test_step_counts_follow_the_scheduler(capsys):
    spec = importlib.util.spec_from_file_location("batching_steps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--sizes", "4", "--budgets", "64", "2048"]) == 0
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 ")]
    (small, large) = [dict(zip(("seqs", "requests", "prompt", "static", "budget", "continuous", "ratio"),
                               map(float, row))) for row in rows]
    # 8 requests, at most 4 running: a 64-token budget cuts the prompts (32 to 256 tokens) into more steps
    assert small["continuous"] > large["continuous"] >= 8
    assert small["continuous"] >= small["prompt"] / 64  # every prompt token passes through some step's budget
