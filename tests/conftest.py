
import pytest
import torch

from minfer import LLM
from minfer.course import IMPLS
from minfer.models.loader import load_model, save_hf_checkpoint


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The real SmolLM2-135M in float32 on CPU, loaded once for the whole session."""
    return LLM("smollm2-135m", dtype="float32", device="cpu")


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
    parser.addoption("--impl", choices=IMPLS, default="solutions",
                     help="which code the chapter tests check: your exercises/ or the solutions/")


def pytest_configure(config):
    # One torch thread per test process: decode is memory-bound (a second thread buys little), tiny
    # test models are too small to split, and two threads slow down 10x when the other core is busy.
    # The Makefile runs two test processes instead (pytest-xdist), one per core.
    torch.set_num_threads(1)
