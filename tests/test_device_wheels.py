"""benchmarks/device_wheels.py: which packages travel to a GPU machine as wheels (no download here)."""
import sys

from minfer.lab.course import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import device_wheels  # noqa: E402


def test_canonical_names():
    assert device_wheels.canonical("Typing_Extensions") == "typing-extensions"
    assert device_wheels.canonical("jupyter.core") == "jupyter-core"


def test_the_closure_follows_dependencies_at_installed_versions():
    from importlib import metadata

    closure = device_wheels.dependency_closure(("ipykernel",))
    assert {"ipykernel", "jupyter-client", "pyzmq", "traitlets", "tornado"} <= set(closure)
    assert closure["pyzmq"] == metadata.version("pyzmq")
    assert "nbclient" not in closure  # only what ipykernel needs


def test_what_the_device_has_stays_behind():
    pins = device_wheels.wheels_to_carry()
    names = {pin.split("==")[0] for pin in pins}
    assert {"ipykernel", "nbclient", "ipywidgets", "gguf", "fastapi", "uvicorn", "openai", "pydantic-core"} <= names
    closure = device_wheels.dependency_closure()
    assert "numpy" in closure and "numpy" not in names  # gguf needs numpy; the image has it
    assert not names & device_wheels.DEVICE_IMAGE
