"""Shared fixtures: the real model, its transformers reference, and the tiny random models.

The tiny models are built by `minfer.testing` (one builder per kind); the fixtures here give each
variant a name, build it once per test process, and never write into it (a test that changes its
model's files builds its own copy in tmp_path).
"""
import os

import pytest
import torch

from minfer import LLM
from minfer.course import IMPLS
from minfer.models.loader import load_model, save_hf_checkpoint
from minfer.testing import random_checkpoint, tiny_hf_checkpoint


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The real SmolLM2-135M in float32 on CPU, loaded once for the whole session."""
    return LLM("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, llm):
    """tiny_checkpoint(model_type="llama", tie=True, **config) -> the folder of a tiny random transformers
    model with SmolLM2's tokenizer (`minfer.testing.tiny_hf_checkpoint`), built once per set of arguments."""
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
    """`minfer.testing.random_checkpoint`'s "tiny" shape (seed 1): vocabulary 512, a word-level tokenizer."""
    return random_checkpoint(str(tmp_path_factory.mktemp("random_tiny")), "tiny", seed=1)


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


def pytest_configure(config):
    # One torch thread per test process: decode is memory-bound (a second thread buys little), tiny
    # test models are too small to split, and two threads slow down 10x when the other core is busy.
    # The Makefile runs two test processes instead (pytest-xdist), one per core.
    torch.set_num_threads(1)
