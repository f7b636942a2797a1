"""The load generator: `python -m minfer bench serve`, in the spirit of `vllm bench serve`.

It measures any OpenAI-compatible server (minfer's, llama.cpp's, vLLM's) over HTTP, the way
users meet it: requests arrive one by one at random times, each streams its tokens back, and
what counts is the latency each user sees at a given load.

    python -m minfer bench serve --base-url http://127.0.0.1:8000 --request-rate 2 --num-prompts 64
    python -m minfer bench serve --base-url http://127.0.0.1:8000 --sweep 0.5,1,2,4 --goodput ttft:2000
    python -m minfer bench serve --launch --sweep 0.125,0.25,0.5,1,2 --goodput ttft:2000   # starts the servers itself

The pieces, one small public function per formula (chapter 09 imports and plots them):

* Arrivals (`arrival_times`): gaps between requests drawn from a gamma distribution of shape
  `burstiness` and mean 1 / request_rate, as vLLM draws them; burstiness 1 is a Poisson process,
  below 1 burstier, above 1 more regular. request_rate = inf sends everything at once.
* The workload (`sample_requests`): prompts cut from the Python documentation shipped with
  CPython (`pydoc_data.topics`, nothing to download), lengths uniform in `--input-len`, output
  lengths spread widely over `--output-len` (log-uniform by default: many short answers, a long
  tail). Each request asks for `max_tokens` = its drawn length with `ignore_eos`, so the server
  really generates that many tokens (as vLLM's benchmark does).
* One request (`send_request`): a streamed `POST /v1/completions`. TTFT is the time from sending
  the request to the first streamed chunk; ITL the gaps between chunks; E2EL the time to the last
  chunk; TPOT = (E2EL - TTFT) / (output tokens - 1) (`time_per_output_token`). Output tokens are
  the server's own count (`usage`, asked for with `stream_options.include_usage`) when it sends one.
* The summary (`summarize_results`): mean, median, p90, p99 of TTFT, TPOT, ITL and E2EL in ms,
  request and token throughput, and goodput (`request_goodput`): requests per second that met
  every SLO given with `--goodput ttft:MS tpot:MS e2el:MS`. Field names are vLLM's, so the same
  plotting code reads both tools' JSON.
* A sweep over request rates: the latency-throughput curve, its knee (`find_knee`) and the
  sustainable request rate (`sustainable_rate`: the highest swept rate whose p99 TTFT meets the
  TTFT SLO).
* `--launch` starts the servers itself, one after another on free local ports (minfer with
  continuous batching, minfer with `--max-num-seqs 1`, and llama.cpp's server where installed),
  waits for each to answer, sweeps it, stops it with SIGTERM.

Every request goes to a loopback address (127.0.0.1, localhost, ::1); every run is bounded in
requests (`--num-prompts`) and in wall time (`--max-duration`), and stops by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union
from urllib.parse import urlparse

import httpx

from minfer.bench.common import machine_info, write_docs_section
from minfer.bench.serving import corpus_text, make_workload, percentile  # noqa: F401  (re-exported for chapter 09)
from minfer.models.loader import load_tokenizer  # also chapter 09's bench.load_tokenizer

DOCS_START = "<!-- bench_serve:start -->"
DOCS_END = "<!-- bench_serve:end -->"
DOCS_HEADING = "## Serving under load: `python -m minfer bench serve`"

SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may constrain (vLLM's keys), in ms
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)  # reported beside mean and median
DEFAULT_TTFT_SLO_MS = 2000.0  # a sweep's sustainable rate: p99 TTFT within 2 s, unless --goodput says otherwise
KNEE_TOLERANCE = 0.05  # the knee: the lowest rate whose goodput is within 5% of the sweep's best
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_MODEL = "smollm2-135m"
MIN_SWEEP_PROMPTS = 16  # with --sweep-duration: never fewer requests than this at one rate
# Targets on CPU (issue 11): sustainable rate under p99 TTFT <= 2 s, minfer against its one-at-a-time
# server, and against llama.cpp's server where that one is measured.
TARGETS = {"minfer_vs_one_at_a_time": 5.0, "minfer_vs_llama_cpp": 2.0}
SERVERS = ("minfer", "minfer-seq", "llama-cpp")
SERVER_LABELS = {"minfer": "minfer (continuous batching)", "minfer-seq": "minfer --max-num-seqs 1 (one at a time)",
                 "llama-cpp": "llama.cpp server (llama-cpp-python)"}


# --------------------------------------------------------------------------- arrivals

def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds after the start (the first at 0).

    The gaps are independent gamma draws with shape k = burstiness and scale 1 / (rate * k): their
    mean is 1 / rate whatever k is, their coefficient of variation 1 / sqrt(k). k = 1 gives
    exponential gaps, a Poisson process; k < 1 bunches requests into bursts; large k approaches a
    metronome. request_rate = inf sends every request at 0.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    check_rate(request_rate)
    if not burstiness > 0 or math.isinf(burstiness):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return times


def check_rate(request_rate: float) -> float:
    """A request rate must be > 0 (requests per second; inf = all at once)."""
    if not request_rate > 0:  # also refuses nan
        raise ValueError(f"request rate must be > 0 requests/s (or inf: all at once), got {request_rate}")
    return request_rate


# --------------------------------------------------------------------------- the workload

@dataclass
class RequestSpec:
    """One request of the workload: its prompt as text, that prompt's length in tokens, the tokens to generate."""

    prompt: str
    prompt_len: int
    max_tokens: int


def sample_requests(tokenizer, num_prompts: int, input_len: tuple[int, int] = (32, 256),
                    output_len: tuple[int, int] = (8, 128), output_dist: str = "loguniform",
                    seed: int = 0) -> list[RequestSpec]:
    """`num_prompts` requests cut from the Python docs (deterministic given seed): prompt lengths uniform in
    `input_len`, output lengths in `output_len`, log-uniform (as many in 8-32 as in 32-128) or uniform.

    The prompts are sent as text, so a server re-tokenizes them: its count (usage.prompt_tokens) can
    differ from `prompt_len` by a token or two at the cut's edges, and the summary uses its count."""
    workload = make_workload(tokenizer, num_prompts, input_len, output_len, seed, output_dist)
    return [RequestSpec(tokenizer.decode(r.prompt_token_ids), len(r.prompt_token_ids), r.max_tokens) for r in workload]


# --------------------------------------------------------------------------- one request

@dataclass
class RequestResult:
    """What one streamed request measured. Times in seconds; ttft/latency are None when it failed."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: Optional[float] = None  # sending -> first streamed chunk
    itl: list[float] = field(default_factory=list)  # gaps between successive chunks
    latency: Optional[float] = None  # sending -> last streamed chunk (E2EL)
    start_time: float = 0.0  # when it was sent, seconds after the run started
    generated_text: str = ""
    usage: bool = False  # the server counted the tokens itself (a final `usage` chunk)


def check_loopback(base_url: str) -> str:
    """Load tests send traffic to this machine only: refuse any host but a loopback address."""
    parsed = urlparse(base_url)
    if parsed.scheme not in ("http", "https") or parsed.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"--base-url must be http://HOST:PORT with HOST one of {', '.join(LOOPBACK_HOSTS)} "
                         f"(load tests stay on this machine), got {base_url!r}")
    return base_url.rstrip("/")


async def send_request(client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec,
                       temperature: float = 0.0, ignore_eos: bool = True) -> RequestResult:
    """Send one streamed completion request and time its chunks (Server-Sent Events `data: {json}` lines)."""
    payload = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": temperature,
               "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extra field: generate exactly max_tokens
    result = RequestResult(prompt_len=spec.prompt_len)
    chunks: list[str] = []
    sent = time.perf_counter()
    last = sent
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and ': comment' keep-alives
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"error in stream: {chunk['error']}"
                    return result
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks.append(chunk["choices"][0].get("text") or "")
                if chunk.get("usage"):  # the final chunk (choices: []) when include_usage is on
                    result.usage = True
                    result.output_len = chunk["usage"].get("completion_tokens", 0)
                    result.prompt_len = chunk["usage"].get("prompt_tokens", spec.prompt_len)
    except Exception as exc:  # connection refused or reset, timeout, a line that is not JSON
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if result.ttft is None:
        result.error = "the stream ended without a token"
        return result
    result.latency = last - sent
    result.generated_text = "".join(chunks)
    if not result.usage:
        result.output_len = len(chunks)  # no count from the server: one token per chunk (run_load can retokenize)
    result.success = True
    return result


def time_per_output_token(latency: float, ttft: float, output_len: int) -> Optional[float]:
    """TPOT: the time after the first token, shared among the other output tokens; None with fewer than 2."""
    if output_len < 2:
        return None
    return (latency - ttft) / (output_len - 1)


# --------------------------------------------------------------------------- one run

async def run_load(base_url: str, model: str, specs: Sequence[RequestSpec], request_rate: float = math.inf,
                   burstiness: float = 1.0, seed: int = 0, max_concurrency: Optional[int] = None,
                   endpoint: str = "/v1/completions", temperature: float = 0.0, ignore_eos: bool = True,
                   request_timeout_s: float = 300.0, max_duration_s: float = 600.0, progress: bool = True,
                   label: str = "", count_tokens: Optional[Callable[[str], int]] = None
                   ) -> tuple[list[RequestResult], float]:
    """Send `specs` on the arrival schedule and wait for them all: (results in the specs' order, duration in s).

    Bounded: `max_duration_s` after the last request is sent (the schedule itself is bounded: so many
    requests at such a rate), the requests still running are cancelled and count as failed.
    `max_concurrency` caps the requests in flight (a request waits for a free place before it is sent)."""
    from tqdm.auto import tqdm

    url = check_loopback(base_url) + endpoint
    offsets = arrival_times(len(specs), request_rate, burstiness, seed)
    limits = httpx.Limits(max_connections=max_concurrency or max(1, len(specs)), max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    places = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), desc=label or f"{request_rate:g} req/s", unit="req", disable=not progress,
               leave=False)
    # trust_env=False: no proxy from the environment ever sees this traffic
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        start = time.perf_counter()

        async def one(spec: RequestSpec, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with places or contextlib.nullcontext():
                sent_at = time.perf_counter() - start
                result = await send_request(client, url, model, spec, temperature, ignore_eos)
            result.start_time = sent_at
            bar.update(1)
            return result

        tasks = [asyncio.create_task(one(spec, offset)) for spec, offset in zip(specs, offsets)]
        if tasks:
            await asyncio.wait(tasks, timeout=offsets[-1] + max_duration_s)
        duration = time.perf_counter() - start
        results = []
        for spec, task in zip(specs, tasks):
            if task.done():
                results.append(task.result())
            else:
                task.cancel()
                results.append(RequestResult(prompt_len=spec.prompt_len,
                                             error=f"cancelled: still running {max_duration_s:g} s after the last "
                                                   "request was sent (--max-duration)"))
        await asyncio.gather(*tasks, return_exceptions=True)  # let the cancelled ones close their connections
    bar.close()
    if count_tokens is not None:  # a server that sent no usage: count the streamed text with the tokenizer
        for r in results:
            if r.success and not r.usage:
                r.output_len = count_tokens(r.generated_text)
    return results, duration


# --------------------------------------------------------------------------- statistics

def latency_summary(values_s: Sequence[float], name: str, percentiles: Sequence[float] = PERCENTILES) -> dict:
    """mean_, median_, std_ and p{q}_ `name`_ms of values given in seconds (vLLM's keys); None when empty."""
    ms = [v * 1000.0 for v in values_s]
    out = {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None}
    out.update({f"p{q:g}_{name}_ms": None for q in percentiles})
    if ms:
        mean = sum(ms) / len(ms)
        out[f"mean_{name}_ms"] = mean
        out[f"median_{name}_ms"] = percentile(ms, 50)
        out[f"std_{name}_ms"] = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))  # numpy's std (ddof 0)
        for q in percentiles:
            out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out


def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """['ttft:2000', 'tpot:100'] -> {'ttft': 2000.0, 'tpot': 100.0} (milliseconds); a clear error otherwise."""
    slos: dict[str, float] = {}
    for item in items or ():
        for part in str(item).replace(",", " ").split():
            key, sep, value = part.partition(":")
            if not sep or not key or not value:
                raise ValueError(f"malformed --goodput item {part!r}: write METRIC:MILLISECONDS, "
                                 f"e.g. ttft:2000, with METRIC one of {', '.join(SLO_METRICS)}")
            if key not in SLO_METRICS:
                raise ValueError(f"unknown SLO metric {key!r} in --goodput: use {', '.join(SLO_METRICS)}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput {part!r}: {value!r} is not a number of milliseconds") from None
            if not ms > 0 or math.isinf(ms):
                raise ValueError(f"--goodput {part!r}: the SLO must be a positive number of milliseconds")
            slos[key] = ms
    return slos


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Did this request meet every given SLO? A failed request meets none; a request of one output token
    has no TPOT and so cannot miss a TPOT SLO."""
    if not result.success:
        return False
    values_ms = {"ttft": result.ttft * 1000.0, "e2el": result.latency * 1000.0}
    tpot = time_per_output_token(result.latency, result.ttft, result.output_len)
    values_ms["tpot"] = 0.0 if tpot is None else tpot * 1000.0
    return all(values_ms[key] <= limit for key, limit in slos_ms.items())


def request_goodput(results: Sequence[RequestResult], slos_ms: dict[str, float], duration_s: float) -> float:
    """Goodput: requests that met every SLO, per second of the run."""
    return sum(meets_slos(r, slos_ms) for r in results) / duration_s


def summarize_results(results: Sequence[RequestResult], duration_s: float,
                      slos_ms: Optional[dict[str, float]] = None, **extra) -> dict:
    """One run's summary with vLLM's field names (and its per-request lists); `extra` is stored alongside."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [t for r in ok if (t := time_per_output_token(r.latency, r.ttft, r.output_len)) is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    summary = {**extra, "num_prompts": len(results), "completed": len(ok), "failed": len(results) - len(ok),
               "duration": duration_s, "total_input_tokens": total_in, "total_output_tokens": total_out,
               "request_throughput": len(ok) / duration_s,
               "request_goodput": request_goodput(results, slos_ms, duration_s) if slos_ms else None,
               "goodput_slos_ms": dict(slos_ms or {}),
               "output_throughput": total_out / duration_s,
               "total_token_throughput": (total_in + total_out) / duration_s}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        summary.update(latency_summary(values, name))
    # per request, in the order sent (None where a request failed), rounded to 10 us to keep the JSON small
    summary["input_lens"] = [r.prompt_len for r in results]
    summary["output_lens"] = [r.output_len if r.success else 0 for r in results]
    summary["ttfts"] = [None if r.ttft is None or not r.success else round(r.ttft, 5) for r in results]
    summary["itls"] = [[round(g, 5) for g in r.itl] if r.success else [] for r in results]
    summary["e2els"] = [None if not r.success else round(r.latency, 5) for r in results]
    summary["start_times"] = [round(r.start_time, 4) for r in results]
    summary["errors"] = [r.error for r in results]
    return summary


# --------------------------------------------------------------------------- sweeps

def sustainable_rate(runs: Sequence[dict], slo_ttft_ms: float = DEFAULT_TTFT_SLO_MS, q: float = 99) -> Optional[float]:
    """The highest swept request rate whose p{q} TTFT met the SLO with every request completed; None if none did.

    A rate at which some requests failed (errors, 503s, the run's time limit) is not sustainable."""
    good = [run["request_rate"] for run in runs
            if run["failed"] == 0 and run[f"p{q:g}_ttft_ms"] is not None and run[f"p{q:g}_ttft_ms"] <= slo_ttft_ms]
    return max(good) if good else None


def find_knee(runs: Sequence[dict], tolerance: float = KNEE_TOLERANCE) -> Optional[float]:
    """The knee of the curve: the lowest swept rate whose goodput reaches (1 - tolerance) of the sweep's best.

    Past it, offering more load buys less than `tolerance` more goodput (or loses some, once requests
    miss their SLO): that is where the waiting line starts to grow faster than the server can serve it.
    If the best goodput is at the highest rate swept, the knee may lie beyond the sweep."""
    points = sorted((run["request_rate"], run["request_goodput"] if run["request_goodput"] is not None
                     else run["request_throughput"]) for run in runs)
    if not points:
        return None
    best = max(g for _, g in points)
    return next(rate for rate, g in points if g >= (1 - tolerance) * best)


def past_knee(run: dict, slo_ttft_ms: float = DEFAULT_TTFT_SLO_MS) -> bool:
    """Is this run clearly past the server's knee? Its median TTFT missed the SLO, or it lost requests."""
    return run["failed"] > 0 or run["median_ttft_ms"] is None or run["median_ttft_ms"] > slo_ttft_ms


def prompts_for_rate(rate: float, num_prompts: int, sweep_duration_s: Optional[float]) -> int:
    """Requests sent at one swept rate: num_prompts, or with a sweep duration about rate x duration of them
    (at least MIN_SWEEP_PROMPTS, at most num_prompts), so that low rates do not take minutes each."""
    if sweep_duration_s is None or math.isinf(rate):
        return num_prompts
    return max(min(MIN_SWEEP_PROMPTS, num_prompts), min(num_prompts, math.ceil(rate * sweep_duration_s)))


def parse_rates(text: str) -> list[float]:
    """'0.25,0.5,1,inf' -> [0.25, 0.5, 1.0, inf], each > 0, in increasing order."""
    try:
        rates = [float(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValueError(f"--sweep takes request rates separated by commas, e.g. 0.25,0.5,1,2 (got {text!r})") from None
    if not rates:
        raise ValueError("--sweep needs at least one request rate, e.g. 0.25,0.5,1,2")
    for rate in rates:
        check_rate(rate)
    return sorted(set(rates))


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'32:256' -> (32, 256); '64' -> (64, 64). Lengths in tokens, >= 1."""
    lo, sep, hi = str(text).partition(":")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise ValueError(f"{what} takes LO:HI or N tokens, e.g. 32:256, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"{what} needs 1 <= LO <= HI, got {text!r}")
    return bounds


# --------------------------------------------------------------------------- servers started here

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
    log_path = Path(log_path or tempfile.mkstemp(prefix="minfer_bench_serve_", suffix=".log")[1])
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


# --------------------------------------------------------------------------- measuring one server

def measure_server(base_url: str, model: str, tokenizer, args: argparse.Namespace, name: str,
                   rates: Sequence[float], slos_ms: dict[str, float]) -> dict:
    """A warm-up request, then one run per rate (increasing).

    A sweep stops after the first rate whose *median* TTFT misses the TTFT SLO, or that lost requests:
    the server is then clearly past its knee (half the requests waited too long), and every higher
    rate would only take longer to drain. A p99 miss alone does not stop it: with a few dozen requests
    per rate, p99 is close to the maximum, and one unlucky request can miss at a rate the server does
    sustain."""
    progress = not args.disable_tqdm
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    warm = RequestSpec("The Python language", 3, 4)
    results, _ = asyncio.run(run_load(base_url, model, [warm], math.inf, endpoint=args.endpoint, progress=False,
                                      request_timeout_s=args.request_timeout, max_duration_s=args.request_timeout))
    if not results[0].success:
        raise RuntimeError(f"{name}: the server at {base_url} failed a test request: {results[0].error}")
    slo_ttft = slos_ms.get("ttft", DEFAULT_TTFT_SLO_MS)
    runs = []
    for index, rate in enumerate(rates):
        n = prompts_for_rate(rate, args.num_prompts, args.sweep_duration)
        # another seed per rate: the same prompts again would be prefix-cache hits at the next rate
        specs = sample_requests(tokenizer, n, args.input_len, args.output_len, args.output_dist, args.seed + 1000 * index)
        results, duration = asyncio.run(run_load(
            base_url, model, specs, rate, args.burstiness, args.seed + index, args.max_concurrency, args.endpoint,
            args.temperature, not args.no_ignore_eos, args.request_timeout, args.max_duration, progress,
            f"{name} @ {rate:g} req/s", count))
        run = summarize_results(results, duration, slos_ms, request_rate=rate, burstiness=args.burstiness,
                                max_concurrency=args.max_concurrency, load_1min_after=_load())
        runs.append(run)
        if progress:
            print(f"[bench serve] {name} @ {rate:g} req/s: {run['completed']}/{run['num_prompts']} done in "
                  f"{duration:.1f} s, p99 TTFT {_num(run['p99_ttft_ms'])} ms, {run['output_throughput']:.1f} output tok/s",
                  file=sys.stderr)
        if len(rates) > 1 and past_knee(run, slo_ttft) and not args.no_early_stop:
            break
    return {"name": name, "base_url": base_url, "model_id": model, "runs": runs,
            "sustainable_rate": sustainable_rate(runs, slo_ttft), "knee_rate": find_knee(runs),
            "max_goodput": max((r["request_goodput"] or 0.0) for r in runs) if slos_ms else None,
            "rates_skipped": [r for r in rates if r not in [run["request_rate"] for run in runs]]}


def _load() -> Optional[float]:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """Threads for a launched server: all cores by default, as only one server runs at a time."""
    threads = str(args.server_threads or os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def server_command(name: str, args: argparse.Namespace, model: str, port: int, served_name: str) -> Optional[list[str]]:
    """The command that starts server `name` of --servers on 127.0.0.1:port; None for llama-cpp where it is not installed."""
    extra = [part for arg in args.server_arg or () for part in shlex.split(arg)]
    if name == "minfer":
        return minfer_server_command(model, port, served_name, args.dtype, args.max_num_seqs, extra)
    if name == "minfer-seq":
        return minfer_server_command(model, port, served_name, args.dtype, 1, extra)
    if name == "llama-cpp" and importlib.util.find_spec("llama_cpp") is not None:
        from minfer.models.loader import resolve_model_path

        threads = int(server_env(args)["OMP_NUM_THREADS"])
        return llama_cpp_server_command(resolve_model_path(model), port, served_name, threads)
    return None


# --------------------------------------------------------------------------- the command line

def _rate(text: str) -> float:
    try:
        return check_rate(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc) if "must be" in str(exc) else
                                         f"request rate must be a number > 0 or inf, got {text!r}") from None


def _positive(kind: type) -> Callable[[str], Union[int, float]]:
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return convert


def _argtype(parse: Callable, *extra) -> Callable[[str], object]:
    """An argparse type from one of the parse_ functions above: their ValueError becomes argparse's clear error."""
    def convert(text: str):
        try:
            return parse(text, *extra)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _slo_item(text: str) -> str:
    """One --goodput item, checked at parse time for a clear error; kept as text (check_args parses them all)."""
    parse_goodput([text])
    return text


def add_serve_bench_arguments(parser: argparse.ArgumentParser, docs_page: Union[str, Path, None] = None) -> None:
    """The load generator's options (vLLM's names where `vllm bench serve` has them)."""
    g = parser.add_argument_group("target")
    g.add_argument("--base-url", default=None,
                   help="a running server, e.g. http://127.0.0.1:8000 (loopback only; the default without --launch)")
    g.add_argument("--launch", action="store_true",
                   help="start the servers of --servers here, one after another on free ports, and measure each")
    g.add_argument("--servers", default="minfer,minfer-seq,llama-cpp",
                   type=lambda s: [x for x in s.split(",") if x],
                   help=f"with --launch, any of {', '.join(SERVERS)} (llama-cpp only where llama-cpp-python is installed)")
    g.add_argument("--model", default=None,
                   help=f"with --launch: the model to serve (default {DEFAULT_MODEL}); else the model name to request "
                        "(default: the first one GET /v1/models lists)")
    g.add_argument("--tokenizer", default=None, help="model whose tokenizer cuts the prompts (default: --model, "
                                                      f"else {DEFAULT_MODEL})")
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--dtype", default="bfloat16", help="with --launch: the servers' dtype (bfloat16 is the fast one on CPU)")
    g.add_argument("--max-num-seqs", type=_positive(int), default=None,
                   help="with --launch: the continuous-batching server's max_num_seqs (default: the engine's)")
    g.add_argument("--server-arg", action="append", default=None, metavar="ARGS",
                   help="with --launch: more arguments for the minfer servers, e.g. --server-arg='--max-model-len 1024'")
    g.add_argument("--server-threads", type=_positive(int), default=None,
                   help="with --launch: OMP_NUM_THREADS of each server (default: all cores; one server runs at a time)")
    g.add_argument("--startup-timeout", type=_positive(float), default=300.0, help="seconds a server may take to be ready")
    w = parser.add_argument_group("workload")
    w.add_argument("--num-prompts", type=_positive(int), default=64, help="requests per run (per rate in a sweep)")
    w.add_argument("--input-len", type=_argtype(parse_range, "--input-len"), default=(32, 256),
                   help="prompt lengths in tokens, LO:HI (uniform) or N (default 32:256)")
    w.add_argument("--output-len", type=_argtype(parse_range, "--output-len"), default=(8, 128),
                   help="output lengths in tokens, LO:HI or N (default 8:128)")
    w.add_argument("--output-dist", choices=("loguniform", "uniform"), default="loguniform",
                   help="how output lengths spread over --output-len (loguniform: many short, a long tail)")
    w.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (by default ignore_eos: every request generates its max_tokens)")
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    w.add_argument("--seed", type=int, default=0)
    a = parser.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    a.add_argument("--burstiness", type=_positive(float), default=1.0,
                   help="shape of the gamma inter-arrival times (1 = Poisson, < 1 burstier, > 1 more regular)")
    a.add_argument("--max-concurrency", type=_positive(int), default=None, help="at most this many requests in flight")
    a.add_argument("--sweep", type=_argtype(parse_rates), default=None, metavar="RATES",
                   help="request rates to sweep, e.g. 0.25,0.5,1,2,4 (instead of --request-rate)")
    a.add_argument("--sweep-duration", type=_positive(float), default=None, metavar="S",
                   help=f"in a sweep, send about rate x S requests per rate (at least {MIN_SWEEP_PROMPTS}, "
                        "at most --num-prompts)")
    a.add_argument("--no-early-stop", action="store_true",
                   help="sweep every rate (by default a sweep stops after the first rate whose median TTFT misses the SLO)")
    a.add_argument("--goodput", nargs="+", type=_argtype(_slo_item), default=None, metavar="METRIC:MS",
                   help=f"SLOs for goodput, e.g. ttft:2000 tpot:100 ({', '.join(SLO_METRICS)}, in ms); a sweep's "
                        f"sustainable rate uses the ttft one (default {DEFAULT_TTFT_SLO_MS:g} ms)")
    a.add_argument("--request-timeout", type=_positive(float), default=300.0, help="seconds one request may take")
    a.add_argument("--max-duration", type=_positive(float), default=600.0,
                   help="seconds a run may go on after its last request is sent; what still runs then is "
                        "cancelled and counts as failed")
    o = parser.add_argument_group("output")
    o.add_argument("--json", dest="json_path", default=None, help="write the results here as JSON")
    o.add_argument("--plot", default=None, help="write the latency-throughput curve here (PNG)")
    if docs_page is None:
        o.add_argument("--update-docs", default=None, metavar="PATH",
                       help="replace this benchmark's marked section of the docs page at PATH")
    else:
        o.add_argument("--update-docs", nargs="?", const=str(docs_page), default=None, metavar="PATH",
                       help=f"replace this benchmark's marked section of {docs_page} (or PATH)")
    o.add_argument("--notes", default=None, metavar="FILE", help="markdown appended to the docs section")
    o.add_argument("--render", default=None, metavar="JSON", help="no run: rebuild table, plot and docs from a saved --json")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def check_args(args: argparse.Namespace) -> dict[str, float]:
    """What argparse cannot check alone; returns the SLOs. Raises ValueError naming what is allowed."""
    slos = parse_goodput(args.goodput)
    check_rate(args.request_rate)
    unknown = [s for s in args.servers if s not in SERVERS]
    if unknown:
        raise ValueError(f"unknown server(s) {', '.join(unknown)} in --servers: use {', '.join(SERVERS)}")
    if args.launch and args.base_url:
        raise ValueError("give either --base-url (a running server) or --launch (start the servers here), not both")
    if args.base_url:
        check_loopback(args.base_url)
    if not 1 <= len(args.input_len) == 2 or not 1 <= len(args.output_len) == 2:
        raise ValueError("--input-len and --output-len take LO:HI")
    return slos


def run_serve_bench(args: argparse.Namespace, command: Optional[str] = None) -> int:
    """`python -m minfer bench serve`: measure, print the table, write JSON / plot / docs as asked. Returns 0."""
    if args.render:
        result = json.loads(Path(args.render).read_text())
        return report(result, args)
    slos = check_args(args)
    try:
        result = measure(args, slos, command)
    except RuntimeError as exc:  # a server that would not start or failed its test request: say why, no traceback
        print(f"minfer bench serve: error: {exc}", file=sys.stderr)
        return 1
    return report(result, args)


def measure(args: argparse.Namespace, slos: dict[str, float], command: Optional[str] = None) -> dict:
    """Every run the arguments ask for (the launched servers, or the running one), as one JSON-able dict."""
    started = time.perf_counter()
    rates = args.sweep or [args.request_rate]
    machine = machine_info("cpu")
    servers = []
    if args.launch:
        model = args.model or DEFAULT_MODEL
        tokenizer = load_tokenizer(args.tokenizer or model)
        served_name = Path(model).name if os.path.exists(model) else model
        env = server_env(args)
        for name in args.servers:
            port = free_port()  # a fresh one for each server: the last one's socket may linger
            command_line = server_command(name, args, model, port, served_name)
            if command_line is None:
                print(f"[bench serve] {name}: not installed, skipped", file=sys.stderr)
                continue
            base_url = f"http://127.0.0.1:{port}"
            print(f"[bench serve] starting {name}: {shlex.join(command_line)}", file=sys.stderr)
            with launched_server(command_line, base_url, env, args.startup_timeout):
                server = measure_server(base_url, served_name, tokenizer, args, name, rates, slos)
            server.update(label=SERVER_LABELS[name], command=shlex.join(command_line), env=env)
            servers.append(server)
        if not servers:
            raise ValueError(f"nothing was launched: --servers {','.join(args.servers)} "
                             "(llama-cpp needs llama-cpp-python installed)")
    else:
        base_url = check_loopback(args.base_url or "http://127.0.0.1:8000")
        model = args.model or served_models(base_url)[0]
        tokenizer_name = args.tokenizer or (model if _resolvable(model) else DEFAULT_MODEL)
        tokenizer = load_tokenizer(tokenizer_name)
        server = measure_server(base_url, model, tokenizer, args, model, rates, slos)
        server.update(label=model, command=None)
        servers.append(server)
    if any(s["name"] == "llama-cpp" for s in servers):
        llama_cpp = "measured"
    elif importlib.util.find_spec("llama_cpp") is None:
        llama_cpp = "llama-cpp-python not installed: not measured"
    else:
        llama_cpp = "installed, not asked for (--servers)"
    settings = {"model": model, "dtype": args.dtype if args.launch else None, "endpoint": args.endpoint,
                "num_prompts": args.num_prompts, "sweep_duration": args.sweep_duration,
                "input_len": list(args.input_len), "output_len": list(args.output_len),
                "output_dist": args.output_dist, "ignore_eos": not args.no_ignore_eos,
                "temperature": args.temperature, "seed": args.seed, "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency, "rates": rates, "goodput_slos_ms": slos,
                "slo_ttft_ms": slos.get("ttft", DEFAULT_TTFT_SLO_MS),
                "server_threads": args.server_threads or os.cpu_count(), "max_num_seqs": args.max_num_seqs,
                "server_args": args.server_arg}
    return {"benchmark": "serve", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command or _command_line(),
            "machine": machine, "settings": settings, "servers": servers, "ratios": ratios(servers),
            "llama_cpp": llama_cpp, "elapsed_s": time.perf_counter() - started}


def _command_line() -> str:
    """How this run was started, as `python -m minfer bench serve ...` (sys.argv holds 'bench', 'serve', flags)."""
    flags = sys.argv[3:] if sys.argv[1:3] == ["bench", "serve"] else sys.argv[1:]
    return "python -m minfer bench serve " + shlex.join(flags)


def _resolvable(model: str) -> bool:
    from minfer.models.loader import resolve_model_path

    try:
        resolve_model_path(model)
        return True
    except ValueError:
        return False


def ratios(servers: Sequence[dict]) -> dict:
    """minfer's sustainable rate over the one-at-a-time server's and over llama.cpp's (where both were measured).

    If the other server sustained none of the swept rates, its sustainable rate lies below the lowest
    rate swept, so minfer's rate over that lowest rate is a lower bound on the ratio: stored with
    `<key>_is_lower_bound` True. No ratio (None) when minfer sustained none, or a rate was inf."""
    by = {s["name"]: s for s in servers}
    out = {}
    for other, key in (("minfer-seq", "minfer_vs_one_at_a_time"), ("llama-cpp", "minfer_vs_llama_cpp")):
        if "minfer" not in by or other not in by:
            continue
        mine, theirs = by["minfer"]["sustainable_rate"], by[other]["sustainable_rate"]
        lower_bound = theirs is None
        if lower_bound:
            theirs = min(run["request_rate"] for run in by[other]["runs"])
        finite = mine is not None and not math.isinf(mine) and not math.isinf(theirs)
        out[key] = mine / theirs if finite else None
        out[key + "_is_lower_bound"] = lower_bound and finite
    return out


# --------------------------------------------------------------------------- reporting

def _num(x: Optional[float], digits: int = 0) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def format_table(servers: Sequence[dict]) -> str:
    """Every run of every server as one markdown table row."""
    lines = ["| server | rate (req/s) | done | duration (s) | req/s | output tok/s | goodput (req/s) "
             "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | E2EL p50 / p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in servers:
        for r in s["runs"]:
            lines.append(
                f"| {s['name']} | {r['request_rate']:g} | {r['completed']}/{r['num_prompts']} | {r['duration']:.1f} "
                f"| {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {_num(r['request_goodput'], 2)} | "
                + " | ".join(f"{_num(r[f'median_{m}_ms'])} / {_num(r[f'p99_{m}_ms'])}" for m in LATENCY_METRICS) + " |")
    return "\n".join(lines)


def format_markdown(result: dict) -> str:
    """The docs section: command, machine, workload, the table, sustainable rates and ratios against the targets."""
    m, s = result["machine"], result["settings"]
    slo = s["slo_ttft_ms"]
    if s["sweep_duration"]:
        per_rate = (f"per rate about rate × {s['sweep_duration']:g} s of requests (at least "
                    f"{min(MIN_SWEEP_PROMPTS, s['num_prompts'])}, at most {s['num_prompts']})")
    else:
        per_rate = f"{s['num_prompts']} requests per rate"
    arrivals = "Poisson" if s["burstiness"] == 1 else f"gamma, burstiness {s['burstiness']:g}"
    if s["max_concurrency"]:
        arrivals += f", at most {s['max_concurrency']} in flight"
    slo_text = ", ".join(f"{k} ≤ {v:g} ms" for k, v in s["goodput_slos_ms"].items())
    lines = [f"Command: `{result['command']}`  ",
             f"Machine: {m['cpu']}, {m['cores']} cores, load average {m.get('load_average_1min', '?')} at the start; "
             f"torch {m['torch']}, Python {m['python']}; {result['date']}, {result['elapsed_s'] / 60:.1f} min in all  ",
             f"Workload: {per_rate}, prompts of {s['input_len'][0]}–{s['input_len'][1]} tokens cut from "
             f"`pydoc_data.topics`, outputs of {s['output_len'][0]}–{s['output_len'][1]} tokens ({s['output_dist']}), "
             f"{'EOS ignored' if s['ignore_eos'] else 'stopping at EOS'}, temperature {s['temperature']:g}, "
             f"seed {s['seed']}; arrivals {arrivals}.  ",
             f"SLO: p99 TTFT ≤ {slo:g} ms; " + (f"goodput counts the requests meeting {slo_text}." if slo_text
                                                  else "no --goodput given, so no goodput.")]
    servers = result["servers"]
    if any(sv.get("command") for sv in servers):
        lines += ["", "Servers, one after another on this machine (OMP_NUM_THREADS="
                  f"{s['server_threads']}):", ""]
        lines += [f"- {sv['label']}: `{_short_command(sv['command'])}`" for sv in servers]
    lines += ["", format_table(servers), ""]
    lines.append(f"Sustainable request rate (the highest swept rate whose p99 TTFT ≤ {slo:g} ms with no request lost) "
                 "and the knee (the lowest swept rate whose goodput reaches 95% of the sweep's best):")
    lines.append("")
    for sv in servers:
        skipped = f"; not run (past the knee): {', '.join(f'{r:g}' for r in sv['rates_skipped'])}" if sv["rates_skipped"] else ""
        lines.append(f"- {sv['label']}: sustainable {_rate_text(sv['sustainable_rate'])}, knee "
                     f"{_rate_text(sv['knee_rate'])}, best goodput {_num(sv['max_goodput'], 2)} req/s{skipped}")
    ra = ratios(servers)  # recomputed, so that --render of an older run states them as this code does
    names = {"minfer_vs_one_at_a_time": "minfer / one at a time", "minfer_vs_llama_cpp": "minfer / llama.cpp server"}
    for key, target in TARGETS.items():
        if key not in ra:
            continue
        value = ra[key]
        if value is None:
            verdict = "– (minfer sustained none of the swept rates, or a rate was inf)"
        elif ra[key + "_is_lower_bound"]:
            verdict = (f"≥ {value:.1f}× {'✓' if value >= target else '?'} (a lower bound: the other server sustained "
                       "none of the swept rates, so its rate is below the lowest one swept)")
        else:
            verdict = f"{value:.2f}× {'✓' if value >= target else '✗'}"
        lines.append(f"- {names[key]}, sustainable rate: {verdict} (target ≥ {target:g}×)")
    lines.append(f"- llama.cpp: {result['llama_cpp']}")
    return "\n".join(lines) + "\n"


def _rate_text(rate: Optional[float]) -> str:
    return "none of the swept rates" if rate is None else f"{rate:g} req/s"


def _short_command(command: str) -> str:
    """The server command without the interpreter's full path and the port (both change from run to run)."""
    parts = shlex.split(command)
    parts[0] = "python"
    out = []
    for prev, part in zip([""] + parts[:-1], parts):
        out.append("PORT" if prev == "--port" else part)
    return shlex.join(out)


def plot_sweep(result: dict, path: Union[str, Path]) -> None:
    """The latency-throughput curve: p50 and p99 TTFT and TPOT against achieved output throughput, one line per
    server, the TTFT SLO drawn across; and goodput against the offered request rate."""
    import matplotlib.ticker
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    fig = Figure(figsize=(17, 4.8))
    axes = fig.subplots(1, 3)
    slo = result["settings"]["slo_ttft_ms"]
    colors = {"minfer": "tab:green", "minfer-seq": "tab:gray", "llama-cpp": "tab:orange"}
    for i, server in enumerate(result["servers"]):
        runs = sorted(server["runs"], key=lambda r: r["request_rate"])
        color = colors.get(server["name"], f"C{i}")
        x = [r["output_throughput"] for r in runs]
        for ax, metric in ((axes[0], "ttft"), (axes[1], "tpot")):
            for q, style in (("median", "-o"), ("p99", "--^")):
                y = [r[f"{q}_{metric}_ms"] for r in runs]
                ax.plot(x, [float("nan") if v is None else v / 1000 for v in y], style, color=color,
                        label=f"{server['name']} {'p50' if q == 'median' else q}")
        for r, xi in zip(runs, x):  # which offered rate each point is
            if r["p99_ttft_ms"] is not None:
                axes[0].annotate(f"{r['request_rate']:g}", (xi, r["p99_ttft_ms"] / 1000), textcoords="offset points",
                                 xytext=(3, 4), fontsize=7, color=color)
        finite = [r for r in runs if not math.isinf(r["request_rate"])]
        axes[2].plot([r["request_rate"] for r in finite],
                     [r["request_goodput"] if r["request_goodput"] is not None else r["request_throughput"] for r in finite],
                     "-o", color=color, label=server["name"])
        if server.get("sustainable_rate") and not math.isinf(server["sustainable_rate"]):
            axes[2].axvline(server["sustainable_rate"], color=color, linestyle=":", alpha=0.7)
    axes[0].axhline(slo / 1000, color="tab:red", linestyle=":", label=f"SLO {slo / 1000:g} s")
    axes[0].set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")  # 0.5, 2, 10 rather than 5x10^-1
    axes[0].yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    axes[0].yaxis.set_major_formatter(plain)
    axes[0].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set_ylabel("TTFT (s, log scale)")
    axes[0].set_title("time to first token (numbers: offered req/s)")
    axes[1].set_ylabel("TPOT (s)")
    axes[1].set_title("time per output token")
    for ax in axes[:2]:
        ax.set_xlabel("achieved output throughput (tokens/s)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    rates = [r for r in result["settings"]["rates"] if not math.isinf(r)]
    if rates:
        axes[2].plot(rates, rates, color="black", linewidth=0.8, alpha=0.4, label="goodput = offered rate")
        if max(rates) / min(rates) > 8:  # rates doubling across the sweep: equal steps on a log axis
            axes[2].set_xscale("log", base=2)
            axes[2].set_yscale("log", base=2)
            axes[2].xaxis.set_major_formatter(plain)
            axes[2].yaxis.set_major_formatter(plain)
    axes[2].set_xlabel("offered request rate (req/s)")
    axes[2].set_ylabel("goodput (req/s meeting the SLO)")
    axes[2].set_title("goodput (dotted: sustainable rate)")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    fig.suptitle(f"{result['settings']['model']} {result['settings']['dtype'] or ''}, "
                 f"{result['machine']['cores']} CPU cores: latency against throughput")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=85)


INTRO = ("An OpenAI-compatible server measured over HTTP as users meet it: requests arrive at random (Poisson) "
         "times, stream their tokens, and what counts is TTFT and TPOT percentiles at a given load, and the load a "
         "server sustains within an SLO. The load generator works against any such server (minfer's, llama.cpp's, "
         "vLLM's) and writes vLLM's field names; `--launch` starts the servers itself, one after another on this "
         "machine. How it is measured: `minfer/bench/serve.py`. Regenerate with `python benchmarks/bench_serve.py` "
         "(its docstring has the full command).")


def to_json(result: dict) -> str:
    """Indented JSON with each list of numbers on one line (the per-request lists would take a line per number)."""
    text = json.dumps(result, indent=1)
    return re.sub(r"\[([-0-9.eE,\snul]*)\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)


def report(result: dict, args: argparse.Namespace) -> int:
    """Print the table; write the JSON, the plot and the docs section where asked."""
    markdown = format_markdown(result)
    if args.plot:
        plot_sweep(result, args.plot)
        markdown += f"\n![latency against throughput]({Path(args.plot).name})\n"
    if args.notes:
        markdown += "\n" + Path(args.notes).read_text()
    print(markdown)
    if args.json_path and not args.render:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(to_json(result))
    if args.update_docs:
        write_docs_section(markdown, args.update_docs, DOCS_START, DOCS_END, DOCS_HEADING, INTRO)
    return 0
