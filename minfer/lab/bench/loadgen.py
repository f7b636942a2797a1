"""The load generator's client side: when requests arrive, what they ask for, and how each is timed.

`python -m minfer bench serve` (`minfer.lab.bench.serve`) measures any OpenAI-compatible server (minfer's,
llama.cpp's, vLLM's) over HTTP, the way users meet it: requests arrive one by one at random times, each
streams its tokens back, and what counts is the latency each user sees at a given load. This file sends
the requests; `minfer.lab.bench.latency` turns what they measured into vLLM's summary fields.

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
  chunk. Output tokens are the server's own count (`usage`, asked for with
  `stream_options.include_usage`) when it sends one.
* One run (`run_load`): the requests sent on the arrival schedule, bounded in wall time.

Every request goes to a loopback address (127.0.0.1, localhost, ::1): load tests stay on this machine.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence
from urllib.parse import urlparse

import httpx

from minfer.lab.bench.serving_workload import make_workload

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

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
