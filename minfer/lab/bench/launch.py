"""Servers the benchmarks start themselves: a free port, the command, waiting until it answers, a graceful stop,
and what a server says about itself on /metrics (`server_metrics`).

`python -m minfer bench serve --launch` and the soak test start servers one after another on free
local ports (minfer with continuous batching, minfer with `--max-num-seqs 1`, llama.cpp's server where
installed), wait for each to answer, measure it and stop it with SIGTERM.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import httpx

from minfer.lab.bench.loadgen import check_loopback

def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def minfer_server_command(model: str, port: int, served_model_name: str, dtype: str = "bfloat16",
                          max_num_seqs: Optional[int] = None, extra_args: Sequence[str] = ()) -> list[str]:
    """`python -m minfer serve MODEL ...` on 127.0.0.1:port."""
    command = [sys.executable, "-m", "minfer", "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", served_model_name, "--dtype", dtype]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    return command + list(extra_args)


def llama_cpp_server_command(gguf_path: str, port: int, served_model_name: str, threads: int) -> list[str]:
    """llama-cpp-python's OpenAI-compatible server on the same GGUF file, on 127.0.0.1:port."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", gguf_path, "--host", "127.0.0.1",
            "--port", str(port), "--model_alias", served_model_name, "--n_threads", str(threads), "--n_ctx", "2048"]


def wait_until_ready(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Poll GET /health (or /v1/models, for servers without /health) until one answers 200; bounded by timeout_s."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with code {process.returncode} before it was ready")
            for path in ("/health", "/v1/models"):
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(base_url + path).status_code == 200:
                        return
            time.sleep(0.25)
    raise RuntimeError(f"the server at {base_url} was not ready within {timeout_s:g} s")


def stop_server(process: subprocess.Popen, timeout_s: float = 30.0) -> Optional[int]:
    """SIGTERM (a graceful stop), then SIGKILL if it is still there after timeout_s; returns its exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


@contextlib.contextmanager
def launched_server(command: Sequence[str], base_url: str, env: Optional[dict] = None, startup_timeout_s: float = 300.0,
                    log_path: Optional[Union[str, Path]] = None) -> Iterator[subprocess.Popen]:
    """Start a server subprocess, wait until it answers, yield it; stop it on the way out, whatever happened.

    Its output goes to log_path (the tail is shown when it fails to start)."""
    if log_path is None:
        descriptor, log_path = tempfile.mkstemp(prefix="minfer_bench_serve_", suffix=".log")
        os.close(descriptor)  # reopened below; the log stays for reading afterwards
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **(env or {})})
        try:
            try:
                wait_until_ready(base_url, process, startup_timeout_s)
            except RuntimeError as exc:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{exc}\ncommand: {shlex.join(command)}\nits log ({log_path}), last lines:\n{tail}") from None
            yield process
        finally:
            stop_server(process)


def served_models(base_url: str) -> list[str]:
    """The model ids a running server lists at GET /v1/models."""
    try:
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            response = client.get(check_loopback(base_url) + "/v1/models")
            response.raise_for_status()
            return [m["id"] for m in response.json()["data"]]
    except httpx.HTTPError as exc:
        raise ValueError(f"no OpenAI-compatible server answers GET {base_url}/v1/models ({exc}): start one "
                         "(python -m minfer serve), or pass --launch to start the servers here") from None


def server_metrics(base_url: str) -> dict[str, float]:
    """The server's gauges and counters from GET /metrics, by name without the `minfer:` prefix."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^minfer:(\w+)\{[^}]*\} (\S+)$", text, re.M)}
