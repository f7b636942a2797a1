"""What loading a GGUF model costs: its header, its weights' decoding, its tokenizer with and without the cache,
the whole `LLM(model)`.

    python benchmarks/bench_load.py [--model smollm2-135m] [--repeats 3]

Each repeat reads the file's header with the gguf package's reader and with minfer's (minfer.formats.gguf_file),
decodes every tensor to float32 with the package's `gguf.quants.dequantize` and with minfer's `dequantize`,
then gets a fresh, empty cache folder (MINFER_CACHE): the tokenizer converted from the file, then read back
from the cache; `LLM(model)` with the cache empty, then filled; then a `max_model_len` the model cannot take,
which fails once the config is read. All in one process, one thread, side by side; best of the repeats.
Last, `LLM(model)` as the first model of a fresh process (cache filled), beside the same after an
`import torch._dynamo`: what building the model on the meta device cost while it ran Python-only ops there.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import gguf
import torch
from minfer import LLM
from minfer.formats.gguf_file import dequantize, read_gguf_file
from minfer.models.loader import gguf_tokenizer, resolve_model_path


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def refused(model: str) -> None:
    try:
        LLM(model, max_model_len=10**7)
    except ValueError:
        return
    raise AssertionError("a max_model_len of 10**7 was accepted")


def first_model_seconds(model: str, import_dynamo: bool) -> float:
    """`LLM(model)` timed in a fresh process (after `import minfer`, tokenizer cached), optionally after importing
    torch._dynamo."""
    code = (f"import time\nfrom minfer import LLM\nstart = time.perf_counter()\n"
            f"{'import torch._dynamo' if import_dynamo else 'pass'}\nLLM({model!r}, dtype='float32')\n"
            f"print(time.perf_counter() - start)")
    env = {k: v for k, v in os.environ.items() if k != "MINFER_CACHE"}  # the user's cache, filled at the start
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(env, OMP_NUM_THREADS="1"))
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = resolve_model_path(args.model)
    if not path.endswith(".gguf"):
        parser.error(f"--model must be a GGUF model (its tokenizer is what gets cached), got {path}")
    gguf_tokenizer(path)  # imports transformers' tokenizer code once, outside the timings
    tensors = list(read_gguf_file(path).tensors.values())
    names = ("gguf reader", "minfer reader", "gguf dequantize", "minfer dequantize", "converted", "cached",
             "LLM cold", "LLM warm", "refused", "first model", "first model + dynamo")
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(args.repeats):
        times["gguf reader"].append(seconds(lambda: gguf.GGUFReader(path)))
        times["minfer reader"].append(seconds(lambda: read_gguf_file(path)))
        times["gguf dequantize"].append(seconds(lambda: [gguf.quants.dequantize(t.data, t.type) for t in tensors]))
        times["minfer dequantize"].append(seconds(lambda: [dequantize(t) for t in tensors]))
        for first, second, fn in (("converted", "cached", lambda: gguf_tokenizer(path)),
                                  ("LLM cold", "LLM warm", lambda: LLM(args.model, dtype="float32"))):
            folder = tempfile.mkdtemp(prefix="minfer_cache_")
            os.environ["MINFER_CACHE"] = folder
            times[first].append(seconds(fn))
            times[second].append(seconds(fn))
            shutil.rmtree(folder)
        times["refused"].append(seconds(lambda: refused(args.model)))
        for name, import_dynamo in (("first model", False), ("first model + dynamo", True)):
            times[name].append(first_model_seconds(args.model, import_dynamo))
    best = {k: min(v) for k, v in times.items()}
    print(f"{args.model}, one thread, best of {args.repeats}\n\n| | s |\n|---|---:|")
    print(f"| the file's header and tensor table, `gguf.GGUFReader` | {best['gguf reader']:.2f} |")
    print(f"| the same, `minfer.formats.gguf_file.read_gguf_file` | {best['minfer reader']:.3f} |")
    print(f"| every tensor decoded to float32, `gguf.quants.dequantize` | {best['gguf dequantize']:.2f} |")
    print(f"| the same, `minfer.formats.gguf_file.dequantize` | {best['minfer dequantize']:.2f} "
          f"({best['minfer dequantize'] / best['gguf dequantize']:.2f}x) |")
    print(f"| the tokenizer converted from the file | {best['converted']:.2f} |")
    print(f"| the same tokenizer read from the cache | {best['cached']:.2f} |")
    print(f"| `LLM(\"{args.model}\")`, empty cache | {best['LLM cold']:.2f} |")
    print(f"| `LLM(\"{args.model}\")`, cache filled | {best['LLM warm']:.2f} ({best['LLM warm'] / best['LLM cold']:.2f}x) |")
    print(f"| `LLM(\"{args.model}\", max_model_len=10**7)` refused | {best['refused']:.2f} |")
    print(f"| `LLM(\"{args.model}\")`, a fresh process's first model | {best['first model']:.2f} |")
    print(f"| the same after `import torch._dynamo` | {best['first model + dynamo']:.2f} "
          f"({best['first model'] / best['first model + dynamo']:.2f}x) |")


if __name__ == "__main__":
    main()
