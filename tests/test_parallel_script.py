"""Tensor parallelism from any script (`minfer.engine.parallel.start_method`).

Spawn starts each worker by running the main script again; a script that builds its LLM at the top
level, without `if __name__ == "__main__":`, gets forked workers instead (or, where fork is unsafe, an
error that names the guard). Each case runs a script of its own in a subprocess, with 2 threads per
process: a forked worker must also run multi-threaded ops after rank 0 has run some (GNU OpenMP).
"""
import json
import os
import subprocess
import sys

import pytest

from minfer.models.loader import load_model
from minfer.lab.testing import random_checkpoint, tiny_hf_checkpoint

ENV = dict(os.environ, OMP_NUM_THREADS="2")

BODY = """
import json, sys
from minfer import LLM, SamplingParams
ENGINE = dict(device="cpu", dtype="float32", num_gpu_blocks_override=48, block_size=8, max_num_seqs=6,
              max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(5 + 4 * i)]} for i in range(4)]

def tokens_and_logprobs(llm):
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return [o.token_ids for o in outs], [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]

def main(folder):
    one, one_lp = tokens_and_logprobs(LLM(folder, **ENGINE))  # rank 0 runs multi-threaded ops before forking
    llm = LLM(folder, tensor_parallel_size=2, **ENGINE)
    two, two_lp = tokens_and_logprobs(llm)
    gap = max(abs(a - b) for x, y in zip(one_lp, two_lp) for a, b in zip(x, y))
    print(json.dumps({"method": llm.engine.runner.workers.start_method, "same": one == two, "gap": gap, "tokens": two}))
"""

@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory) -> str:
    """The tiny model of tests/test_tensor_parallel.py: Qwen2-shaped, 8 query and 4 KV heads."""
    words = random_checkpoint(str(tmp_path_factory.mktemp("tp_words")), "tiny")
    folder = tmp_path_factory.mktemp("tp_qwen2")
    tiny_hf_checkpoint(folder, load_model(words).tokenizer, "qwen2", tie=False, vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    return str(folder)


SCRIPTS = {"unguarded": BODY + "main(sys.argv[1])\n",
           "guarded": BODY + "if __name__ == '__main__':\n    main(sys.argv[1])\n"}


def run(args: list, tmp_path, stdin: str = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=ENV, cwd=tmp_path,
                          timeout=timeout)


@pytest.mark.parametrize("how, method", [("unguarded", "fork"), ("guarded", "spawn")])
def test_tensor_parallel_from_a_script_equals_one_device(tp_dir, tmp_path, how, method):
    """An unguarded script (forked workers) and a guarded one (spawn). (Which code spawn would run again,
    `-c` and stdin among it, is the next tests' matter.)"""
    script = tmp_path / f"tp_{how}.py"
    script.write_text(SCRIPTS[how])
    done = run([str(script), tp_dir], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["method"] == method
    assert result["same"] and result["gap"] < 1e-4 and len(result["tokens"]) == 4


UNSAFE = """
import sys, torch
import torch.multiprocessing as mp
from minfer import LLM
torch.cuda.is_initialized = lambda: True  # as after a CUDA model in this process: a forked child could not use CUDA
try:
    LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", num_gpu_blocks_override=16)
except RuntimeError as e:
    print(len(mp.active_children()), e)
"""


def test_unguarded_script_where_fork_is_unsafe_is_told_the_fix(tp_dir, tmp_path):
    script = tmp_path / "tp_unsafe.py"
    script.write_text(UNSAFE)
    done = run([str(script), tp_dir], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    children, message = done.stdout.strip().split(" ", 1)
    assert children == "0"  # refused before any worker started
    assert "CUDA is initialised" in message and 'if __name__ == "__main__":' in message


PLACES = """
from minfer.engine.parallel import called_from_unguarded_script as unguarded

def where():
    return unguarded()

print("top", unguarded())
print("function", where())
exec("print('exec', unguarded())")
if __name__ == "__main__":
    print("guard", unguarded())
    print("guard-function", where())
if "__main__" == __name__:
    print("reversed",
          unguarded())
"""


def test_which_calls_spawn_would_run_again(tmp_path):
    """True where the code runs at the main script's top level outside the guard, in a file run as a script or with
    `python -m`; never for code without a file (-c, notebooks); always for code from stdin (spawn fails there:
    it looks for a file '<stdin>' to run again)."""
    (tmp_path / "places.py").write_text(PLACES)
    expected = {"top": "True", "function": "True", "exec": "True", "guard": "False", "guard-function": "False",
                "reversed": "False"}
    for args in (["places.py"], ["-m", "places"]):
        done = run(args, tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert dict(line.split() for line in done.stdout.splitlines()) == expected
    for args, stdin, answer in ((["-c", PLACES], None, "False"), (["-"], PLACES, "True")):
        done = run(args, tmp_path, stdin=stdin, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert set(dict(line.split() for line in done.stdout.splitlines()).values()) == {answer}
