"""What every harness shares: clocks, the machine, transformers as a baseline, and the docs page.

* `synchronize(device)` and `best_time(fn)`: a wall-clock time is only meaningful after queued GPU
  work is done, and the fastest of a few runs is the one least disturbed by other work on the
  machine (interference only ever adds time). Every "best of" in the harnesses and the notebooks
  is this function.
* `StepClock`: a transformers logits processor that notes when each `generate` step produced its
  logits, so transformers' TTFT and TPOT are defined as minfer defines them.
* `machine_info()`: what the numbers were measured on (CPU, cores, threads, load, versions).
* `hf_checkpoint_for` / `load_transformers`: the same weights as a Hugging Face folder, loaded by
  transformers, for the side-by-side baselines.
* `write_docs_section`: every benchmark script owns one marked section of a docs page, whose
  path the script passes in.
"""
from __future__ import annotations

import contextlib
import os
import platform
import time
import warnings
from pathlib import Path
from typing import Callable, Union

import torch


def synchronize(device: Union[str, torch.device]) -> None:
    """Wait for queued GPU work, so a clock read after it means something (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def best_time(fn: Callable[[], object], repeats: int = 3, device: Union[str, torch.device] = "cpu") -> float:
    """Fastest of `repeats` wall-clock runs of fn(), in seconds (GPU work included: synchronized around each)."""
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


class StepClock:
    """A transformers logits processor that only notes when each decode step produced its logits."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def machine_info(device: str = "cpu") -> dict:
    """The CPU (or GPU), its vector instructions as PyTorch uses them (AVX2, AVX512: bfloat16 speed depends on
    them), cores, torch threads, 1-minute load average and library versions."""
    import transformers

    info = {"cpu": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": device}
    if hasattr(os, "getloadavg"):  # other work on the machine: with too few free cores, threads wait on each other
        info["load_average_1min"] = round(os.getloadavg()[0], 2)
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def hf_checkpoint_for(model: str, folder: str) -> str:
    """A Hugging Face directory holding `model`'s weights: the model itself if it is one, else a copy in `folder`.

    A GGUF model is dequantized once and saved, so minfer and transformers load the very same weights.
    """
    from minfer.models.loader import load_model, resolve_model_path, save_hf_checkpoint

    path = resolve_model_path(model)
    if os.path.isdir(path):
        return path
    save_hf_checkpoint(load_model(model, torch.float32), folder)
    return folder


def load_transformers(folder: str, dtype: str, device: str):
    """(model, tokenizer) of transformers from a Hugging Face folder, in `dtype` ('float32', 'bfloat16', ...)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from minfer.config import DTYPES

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)}")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to(device).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@contextlib.contextmanager
def quiet():
    """Silence the warnings libraries print while loading and generating (for notebooks and the CLI)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def add_update_docs_argument(parser, docs_page: Union[str, Path, None]) -> None:
    """--update-docs PATH; with a known docs_page, --update-docs alone means that page (a parser or an argument group)."""
    if docs_page is None:
        parser.add_argument("--update-docs", default=None, metavar="PATH",
                            help="replace this benchmark's marked section of the docs page at PATH")
    else:
        parser.add_argument("--update-docs", nargs="?", const=str(docs_page), default=None, metavar="PATH",
                            help=f"replace this benchmark's marked section of {docs_page} (or PATH)")


def publish_report(markdown: str, args, json_text: Callable[[], str], update_docs: Callable[[str], None],
                   plot: Callable[[str], None], plot_alt: str) -> int:
    """A benchmark script's last step, as its options ask: the plot (linked from the markdown), the notes
    appended, the markdown printed, the JSON written (not when --render re-reads one), the docs section
    replaced. `args` has plot, notes, json_path, render and update_docs. Returns 0, the exit status."""
    if args.plot:
        plot(args.plot)
        markdown += f"\n![{plot_alt}]({Path(args.plot).name})\n"
    if args.notes:
        markdown += "\n" + Path(args.notes).read_text()
    print(markdown)
    if args.json_path and not args.render:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json_text())
    if args.update_docs:
        update_docs(markdown)
    return 0


def write_docs_section(markdown: str, path: Union[str, Path], start: str, end: str, heading: str,
                       intro: str = "") -> None:
    """Replace the text between a benchmark's markers in the docs page at `path`, or append it as a new section.

    Every benchmark script owns one marked section, so reruns replace their own table and nothing else."""
    path = Path(path)
    section = f"{start}\n{markdown.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n{heading}\n\n" + (intro + "\n\n" if intro else "") + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
