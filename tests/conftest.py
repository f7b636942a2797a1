"""Shared fixtures: the real model, its transformers reference, and the tiny random models; the order in
which the test files run (longest first, from tests/durations.json); and, without a GPU, Triton's interpreter.

The tiny models are built by `minfer.lab.testing` (one builder per kind); the fixtures here give each
variant a name, build it once per test process, and never write into it (a test that changes its
model's files builds its own copy in tmp_path).
"""
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

# @triton.jit reads TRITON_INTERPRET when it decorates a function, triton's own tl.max and tl.sum included, so the
# variable must be set before anything imports triton (minfer below does). Without a GPU the Triton kernels then run
# under the interpreter (with numpy) in every test process and the subprocesses it starts; on a GPU they run
# compiled. Set, not defaulted: the kernel tests need the interpreter whatever the shell says.
if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1: the kernels "
                           "cannot be interpreted in this process")
    os.environ["TRITON_INTERPRET"] = "1"

from minfer import LLM  # noqa: E402
from minfer.lab.course import IMPLS  # noqa: E402
from minfer.models.loader import load_model, save_hf_checkpoint  # noqa: E402
from minfer.lab.testing import random_checkpoint, tiny_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The real SmolLM2-135M in float32 on CPU, loaded once for the whole session."""
    return LLM("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, llm):
    """tiny_checkpoint(model_type="llama", tie=True, **config) -> the folder of a tiny random transformers
    model with SmolLM2's tokenizer (`minfer.lab.testing.tiny_hf_checkpoint`), built once per set of arguments."""
    built: dict = {}

    def build(model_type: str = "llama", tie: bool = True, **overrides) -> str:
        key = (model_type, tie, tuple(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny_{model_type}")
            tiny_hf_checkpoint(folder, llm.tokenizer, model_type, tie, **overrides)
            built[key] = str(folder)
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_dir(tiny_checkpoint) -> str:
    """The default tiny model: Llama, 2 layers, hidden size 64, tied head, 256 positions, SmolLM2's tokenizer."""
    return tiny_checkpoint()


@pytest.fixture(scope="session")
def tiny_4k_dir(tiny_checkpoint) -> str:
    """The default tiny model's weights with a 4096-token context (the engine's long prompts and preemption)."""
    return tiny_checkpoint(max_position_embeddings=4096)


@pytest.fixture(scope="session")
def tiny_small_vocab_dir(tiny_checkpoint) -> str:
    """A tiny Llama with an untied head over the first 512 token ids and 512 positions (speculative decoding:
    small enough to enumerate a sampling distribution)."""
    return tiny_checkpoint(tie=False, vocab_size=512, max_position_embeddings=512)


@pytest.fixture(scope="session")
def random_tiny_dir(tmp_path_factory) -> str:
    """`minfer.lab.testing.random_checkpoint`'s "tiny" shape (seed 1): vocabulary 512, a word-level tokenizer."""
    return random_checkpoint(str(tmp_path_factory.mktemp("random_tiny")), "tiny", seed=1)


TINY_KINDS = {"default": "tiny_dir", "4k": "tiny_4k_dir", "small_vocab": "tiny_small_vocab_dir",
              "random": "random_tiny_dir"}


@pytest.fixture(scope="session")
def make_tiny_llm(request):
    """make_tiny_llm(kind="default", **engine_args) -> a new float32 CPU `LLM` over one of the tiny models above
    (TINY_KINDS names the fixture of each kind). The model folder is built when a test first asks for its kind;
    the factory is session-scoped so that module-scoped fixtures can use it too."""
    def make(kind: str = "default", **engine_args) -> LLM:
        return LLM(request.getfixturevalue(TINY_KINDS[kind]), dtype="float32", device="cpu", **engine_args)

    return make


@pytest.fixture(scope="session")
def hf_reference_dir(tmp_path_factory) -> str:
    """The dequantized SmolLM2 weights saved as a plain Hugging Face checkpoint, for transformers."""
    folder = str(tmp_path_factory.mktemp("smollm2_hf"))
    save_hf_checkpoint(load_model("smollm2-135m", torch.float32), folder)
    return folder


@pytest.fixture(scope="session")
def hf_reference_model(hf_reference_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_reference_dir, dtype=torch.float32).eval()


def pytest_addoption(parser):
    # $MINFER_IMPL picks the default, as in the notebooks: MINFER_IMPL=exercises pytest tests/exercises tests yours
    parser.addoption("--impl", choices=IMPLS, default=os.environ.get("MINFER_IMPL") or "solutions",
                     help="which code the chapter tests check: your exercises/ or the solutions/ (default: $MINFER_IMPL, "
                          "else solutions)")
    parser.addoption("--record-durations", action="store_true",
                     help=f"write each test file's seconds (setup, call and teardown of its tests) to {DURATIONS}")


def pytest_configure(config):
    # One torch thread per test process: decode is memory-bound (a second thread buys little), tiny
    # test models are too small to split, and two threads slow down 10x when the other core is busy.
    # The Makefile runs two test processes instead (pytest-xdist), one per core.
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- the order of the files
# `make test` spreads whole files over two processes (--dist loadfile), and each process is handed its
# next file while it still has two tests to go. In pytest-xdist's default order (files with the most
# tests first) a long file with one test, such as the browser test, comes last and leaves the other
# process idle for minutes. So files run longest first, by the seconds a recorded run took
# (`pytest --record-durations ...` rewrites the file; one not in it counts as 1 s a test), and the
# Makefile tells xdist to keep this order (--no-loadscope-reorder).
DURATIONS = Path(__file__).with_name("durations.json")


def test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    tests_per_file: dict[str, int] = defaultdict(int)
    for item in items:
        tests_per_file[test_file(item.nodeid)] += 1
    seconds = {f: recorded.get(f, float(n)) for f, n in tests_per_file.items()}
    items.sort(key=lambda item: -seconds[test_file(item.nodeid)])  # stable: a file's tests keep their order


_recorded_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _recorded_seconds[test_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session):
    # the controller process sees every worker's reports; a worker (it has `workerinput`) writes nothing
    if session.config.getoption("--record-durations") and not hasattr(session.config, "workerinput"):
        DURATIONS.write_text(json.dumps({f: round(s, 1) for f, s in sorted(_recorded_seconds.items(),
                                                                          key=lambda kv: -kv[1])}, indent=1) + "\n")
