"""Run the chapter tests against the worked solutions (default) or your exercises:

    pytest tests/exercises/test_ch01_model.py --impl exercises

(The --impl option itself is declared in tests/conftest.py, so it works from any starting folder.)
"""
from types import ModuleType

import pytest

from minfer.lab.course import load_impl


@pytest.fixture(scope="module")
def impl(request) -> ModuleType:
    """The chapter module under test, chosen by the test file's name: test_ch01_model.py -> ch01_model."""
    chapter = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").split("_")[0]
    return load_impl(chapter, request.config.getoption("--impl"))
