"""The hostile soak: ordinary clients beside hostile ones, through the HTTP server.

    python -m minfer bench soak --server --hostile --seconds 90     # the real model, float32

A server is only as good as its worst client lets it be. For `seconds`, ordinary clients ask
greedy completions of fixed prompts, one after another, while hostile clients, all at once:

* ask for degenerate sampling (a top_p below float32's smallest number, min_p 1, a temperature
  of 1e-300, the widest logprobs), stop strings at the server's length limit, and too much work
  (n, max_tokens) or the wrong types;
* arrive in bursts of 30 at once (the waiting queue's bound must hold: 503s, not a longer queue);
* start a request and stall, mid-headers or mid-body (the read timeout must cut them off);
* read a few tokens of a stream and go away.

Meanwhile a watcher asks GET /health every 50 ms. What must hold: every ordinary answer equals
the answer it got alone before the soak; no response is a 5xx; no KV block is in use once all is
over; /health answers quickly throughout (its p99). (A 503 is no failure: it is the waiting queue's
bound refusing part of a burst, with Retry-After.)
"""
from __future__ import annotations

import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from minfer.lab.bench.launch import free_port, launched_server, minfer_server_command, server_metrics

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are"]
DEGENERATE = [{"top_p": 1e-300}, {"min_p": 1.0, "temperature": 5.0}, {"top_k": 1, "top_p": 5e-324},
              {"temperature": 1e-300, "seed": 2 ** 63 - 1}, {"logprobs": 20, "top_p": 1e-30},
              {"stop": ["ab" * 512, "\n" * 1024]}, {"temperature": 100.0, "min_p": 0.999}]
REFUSED = [{"n": 1000}, {"max_tokens": 10 ** 9}, {"max_tokens": "2"}, {"stream": "yes"}, {"prompt": [True, False]},
           {"stop": "x" * 5000}, {"stop": [str(i) for i in range(100)]}, {"temperature": True}]
SERVER_FLAGS = ["--max-num-seqs", "16", "--max-waiting-requests", "24", "--request-read-timeout", "2"]


class Tally:
    """Status codes and failures, counted from many threads."""

    def __init__(self) -> None:
        self.lock, self.codes, self.mismatches, self.errors = threading.Lock(), {}, [], []

    def code(self, status: int) -> None:
        with self.lock:
            self.codes[status] = self.codes.get(status, 0) + 1

    @property
    def server_errors(self) -> int:
        """5xx other than 503: a 503 is the waiting queue's bound at work (a burst), which clients retry."""
        return sum(n for status, n in self.codes.items() if status >= 500 and status != 503)


def _completion(client: httpx.Client, body: dict, tally: Tally) -> httpx.Response:
    response = client.post("/v1/completions", json={"model": "hostile", **body})
    tally.code(response.status_code)
    return response


def _stream_and_leave(client: httpx.Client, body: dict, tokens: int, tally: Tally) -> None:
    with client.stream("POST", "/v1/completions", json={"model": "hostile", "stream": True, **body}) as response:
        tally.code(response.status_code)
        for i, _ in enumerate(response.iter_lines()):
            if i >= tokens:
                break


def _stall(port: int, mid_body: bool, hold_s: float) -> None:
    """Start a request, then send nothing more for hold_s (or until the server cuts it off)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        sock.sendall(head + (b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{" if mid_body else b"Conte"))
        sock.settimeout(hold_s)
        try:
            while sock.recv(4096):
                pass
        except (TimeoutError, OSError):
            pass


def hostile_soak(model: str, seconds: float = 90.0, dtype: str = "float32", seed: int = 0, max_tokens: int = 24) -> dict:
    """Run the soak against a server started here; returns the figures (see the module's docstring)."""
    port, rng = free_port(), random.Random(seed)
    url = f"http://127.0.0.1:{port}"
    tally, health_ms, stop = Tally(), [], threading.Event()
    greedy = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with launched_server(minfer_server_command(model, port, "hostile", dtype, extra_args=SERVER_FLAGS), url):
        with httpx.Client(base_url=url, timeout=120) as client:
            solo = [_completion(client, {"prompt": p, **greedy}, tally).json()["choices"][0]["text"] for p in PROMPTS]

        def ordinary(index: int) -> int:
            done = 0
            with httpx.Client(base_url=url, timeout=120) as client:
                while not stop.is_set():
                    i = (index + done) % len(PROMPTS)
                    response = _completion(client, {"prompt": PROMPTS[i], **greedy}, tally)
                    if response.status_code == 200 and response.json()["choices"][0]["text"] != solo[i]:
                        tally.mismatches.append((PROMPTS[i], response.json()["choices"][0]["text"]))
                    elif response.status_code == 503:  # a burst filled the queue: back off, as a client should
                        time.sleep(float(response.headers.get("retry-after", 1)))
                    done += response.status_code == 200
            return done

        def hostile(index: int) -> int:
            r, sent = random.Random(seed * 1000 + index), 0
            with httpx.Client(base_url=url, timeout=120) as client:
                while not stop.is_set():
                    kind, prompt = r.choice(["degenerate", "refused", "burst", "stall", "leave"]), r.choice(PROMPTS)
                    try:
                        if kind == "degenerate":
                            _completion(client, {"prompt": prompt, "max_tokens": 16, **r.choice(DEGENERATE)}, tally)
                        elif kind == "refused":
                            _completion(client, {"prompt": prompt, **r.choice(REFUSED)}, tally)
                        elif kind == "burst":
                            with ThreadPoolExecutor(30) as pool:
                                list(pool.map(lambda _: _completion(client, {"prompt": prompt, "max_tokens": 8}, tally),
                                              range(30)))
                        elif kind == "stall":
                            _stall(port, mid_body=r.random() < 0.5, hold_s=10)
                        else:
                            _stream_and_leave(client, {"prompt": prompt, "max_tokens": 200, "ignore_eos": True},
                                              r.randint(1, 5), tally)
                    except httpx.HTTPError as exc:  # a dropped connection: counted as a failure
                        tally.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                    sent += 1
            return sent

        def watch_health() -> None:
            with httpx.Client(base_url=url, timeout=30) as client:
                while not stop.is_set():
                    start = time.perf_counter()
                    client.get("/health")
                    health_ms.append(1000 * (time.perf_counter() - start))
                    time.sleep(0.05)

        with ThreadPoolExecutor(12) as pool:
            watcher = pool.submit(watch_health)
            ordinary_done = [pool.submit(ordinary, i) for i in range(3)]
            hostile_sent = [pool.submit(hostile, i) for i in range(8)]
            time.sleep(seconds)
            stop.set()
            watcher.result()
            answered = sum(f.result() for f in ordinary_done)
            sent = sum(f.result() for f in hostile_sent)
        deadline = time.monotonic() + 30  # disconnected requests are aborted within a step or two
        while time.monotonic() < deadline:
            metrics = server_metrics(url)
            if metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0:
                break
            time.sleep(0.2)
    ordered = sorted(health_ms)
    return {"seconds": seconds, "ordinary_answers": answered, "ordinary_mismatches": len(tally.mismatches),
            "hostile_actions": sent, "status_codes": dict(sorted(tally.codes.items())), "server_errors": tally.server_errors,
            "dropped_connections": len(tally.errors), "running_at_end": metrics["num_requests_running"],
            "waiting_at_end": metrics["num_requests_waiting"], "kv_cache_usage_at_end": metrics["kv_cache_usage_perc"],
            "health_checks": len(ordered), "health_p50_ms": ordered[len(ordered) // 2],
            "health_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "errors": tally.errors[:5]}


def format_hostile(result: dict) -> str:
    return (f"{result['seconds']:.0f} s: {result['ordinary_answers']} ordinary answers, {result['ordinary_mismatches']} "
            f"differ from their solo text; {result['hostile_actions']} hostile actions; status codes "
            f"{result['status_codes']}; 5xx other than the queue's 503: {result['server_errors']}; dropped connections: "
            f"{result['dropped_connections']}; at the end: {result['running_at_end']:.0f} running, "
            f"{result['waiting_at_end']:.0f} waiting, KV use {result['kv_cache_usage_at_end']:.3f}; /health p50 "
            f"{result['health_p50_ms']:.1f} ms, p99 {result['health_p99_ms']:.1f} ms over {result['health_checks']} checks")
