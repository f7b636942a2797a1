"""Run the chapter tests against the worked solutions (default) or your exercises:

    pytest tests/exercises/test_ch01_model.py --impl exercises
"""
from types import ModuleType

import pytest

from minfer.course import IMPLS, load_impl


def pytest_addoption(parser):
    parser.addoption("--impl", choices=IMPLS, default="solutions",
                     help="which code the chapter tests check: your exercises/ or the solutions/")


@pytest.fixture(scope="module")
def impl(request) -> ModuleType:
    """The chapter module under test, chosen by the test file's name: test_ch01_model.py -> ch01_model."""
    chapter = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").split("_")[0]
    return load_impl(chapter, request.config.getoption("--impl"))
