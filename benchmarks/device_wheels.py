"""The wheels a GPU machine without network lacks for benchmarks/gpu_check.sh, downloaded here for its Python.

    python benchmarks/device_wheels.py [--out .whl] [--list]

The GPU machine (docs/gpu.md) has torch, triton, transformers, matplotlib, pytest and many more, but not
the notebooks' kernel (ipykernel, nbclient), the widgets, the model reader (gguf), or the server and its
client (fastapi, uvicorn, openai), and nothing can be installed there from a registry. This script takes
those packages and every dependency they have in this checkout's .venv, at the versions .venv has (the
versions the tests ran with), leaves out what the GPU machine's image already holds (DEVICE_IMAGE: edit it for
yours), and downloads each as a wheel for that machine's Python (3.12 on x86_64 Linux) into --out (`.whl/`,
git-ignored), to be carried to the machine and installed there with `pip install --no-deps --target`.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canonical  # PEP 503: 'Typing_Extensions' -> 'typing-extensions'

NEEDED = ("nbclient", "ipykernel", "ipywidgets", "gguf", "fastapi", "uvicorn", "openai")
DEVICE_PYTHON = "3.12"
DEVICE_MARKERS = {"extra": "", "python_version": DEVICE_PYTHON, "python_full_version": DEVICE_PYTHON + ".0",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The Python packages the GPU machine's image is known to have (an NVIDIA H200 image): edit for yours.
DEVICE_IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())


def dependency_closure(roots: tuple[str, ...] = NEEDED) -> dict[str, str]:
    """{canonical name: installed version} of the roots and everything they require here (no extras),
    as this environment has them installed."""
    found: dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = canonical(pending.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{name} is not installed in this environment ({sys.executable}): run make setup first")
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(DEVICE_MARKERS):
                pending.append(requirement.name)
    return found


def wheels_to_carry(roots: tuple[str, ...] = NEEDED) -> list[str]:
    """'name==version' for each package of the closure that the device's image lacks, sorted."""
    return sorted(f"{name}=={version}" for name, version in dependency_closure(roots).items()
                  if name not in DEVICE_IMAGE)


def download(pins: list[str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", DEVICE_PYTHON, "--implementation", "cp", "-d", str(out)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + pins, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".whl"))
    parser.add_argument("--list", action="store_true", help="print the pins, download nothing")
    args = parser.parse_args(argv)
    pins = wheels_to_carry()
    print("\n".join(pins))
    if not args.list:
        download(pins, args.out)
        size = sum(p.stat().st_size for p in args.out.glob("*.whl"))
        print(f"{len(pins)} wheels in {args.out}/, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
