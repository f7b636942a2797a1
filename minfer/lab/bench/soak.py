"""The soak benchmark: thousands of mixed requests through the engine, memory sampled as they go.

    python -m minfer bench soak --requests 5000 --sample-every 250       # one configuration
    python -m minfer bench soak --server --hostile --seconds 90          # hostile clients: minfer/lab/bench/hostile.py
    python benchmarks/bench_soak.py                                       # the variants side by side, docs

A server runs for days. Whatever grows a little per request (a cache with no bound, a tensor
kept alive, a dict entry nobody deletes) ends it. So the soak feeds the engine the way a busy
server would, a fixed number of requests in flight and a new one as soon as one ends, with
everything mixed in: random prompt and output lengths, random sampling settings, n > 1, stop
strings, logprobs, aborts mid-way and invalid requests. Every `sample_every` requests it
records:

* resident memory (RSS, what the machine actually gives the process) and the Python heap
  (tracemalloc), to tell native growth from Python growth;
* the engine's books: KV blocks in use against blocks held by live sequences (a difference is a
  leaked block), sequences running and waiting, requests the engine still holds.

At the end it drains the engine and checks that nothing is left: no request, no block in use.
`plateau` then says, from the numbers alone, whether memory has stopped growing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

from minfer.lab.bench.hostile import format_hostile, hostile_soak
from minfer.lab.bench.launch import server_metrics  # tests/test_server.py reads it from here too
from minfer.llm import LLM
from minfer.sampling_params import SamplingParams

KINDS = {"plain": 0.55, "sampled_n": 0.1, "stop": 0.1, "logprobs": 0.05, "abort": 0.1, "invalid": 0.1}
DEFAULT_VARIANTS = {  # name -> (engine arguments, environment): what the comparison run measures
    "buckets": ({}, {}),
    "no buckets": ({"bucket_step_shapes": False}, {}),
    "no buckets, oneDNN cache off": ({"bucket_step_shapes": False}, {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}),
    "buckets, oneDNN cache off": ({}, {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}),
}


def rss_mib(pid: Optional[int] = None) -> float:
    """Resident memory of a process (this one by default), in MiB."""
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def prompt_words() -> list[str]:
    """Words of Python's own documentation (installed with Python: nothing to download)."""
    from pydoc_data.topics import topics

    return " ".join(topics[k] for k in sorted(topics)).split()


INVALID = ({"prompt": ""}, {"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"prompt": "word " * 9000})


@dataclass
class SoakRequest:
    kind: str
    prompt: str
    params: dict  # SamplingParams' arguments (made when sent: an invalid one raises then)
    abort_after_steps: int = 0


def random_request(rng: random.Random, words: list[str], max_prompt_words: int = 200) -> SoakRequest:
    """One request of a random kind (KINDS gives the mix), with random lengths and sampling settings."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    n = rng.randint(5, max_prompt_words)
    start = rng.randrange(len(words) - n)
    prompt = " ".join(words[start:start + n])
    if kind == "invalid":  # each of these must be refused with a ValueError, and leave nothing behind
        bad = dict(rng.choice(INVALID))
        return SoakRequest(kind, bad.pop("prompt", prompt), bad)
    greedy = rng.random() < 0.3
    params = dict(temperature=0.0 if greedy else rng.uniform(0.3, 1.2), top_p=rng.choice([1.0, 0.9, 0.7]),
                  top_k=rng.choice([0, 0, 20, 50]), min_p=rng.choice([0.0, 0.0, 0.05]),
                  seed=rng.choice([None, rng.randrange(10**6)]), max_tokens=rng.randint(8, 40))
    if kind == "sampled_n":
        params.update(n=rng.randint(2, 3), temperature=0.8)
    elif kind == "stop":
        params.update(stop=rng.choice([["."], ["\n"], [" the", ","]]))
    elif kind == "logprobs":
        params.update(logprobs=rng.randint(0, 5))
    return SoakRequest(kind, prompt, params, rng.randint(1, 12) if kind == "abort" else 0)


@dataclass
class SoakSample:
    requests: int  # requests sent so far (invalid ones included)
    seconds: float
    rss_mib: float
    heap_mib: float  # Python objects (tracemalloc)
    blocks_in_use: int
    blocks_held: int  # by running sequences (a block shared by a prefix counts once)
    running: int
    waiting: int
    engine_requests: int


def sample(llm: LLM, requests: int, started: float) -> SoakSample:
    snap = llm.engine.snapshot(detail=True)
    held = {b for seq in snap.sequences if seq.state == "running" for b in seq.block_table}
    return SoakSample(requests, time.perf_counter() - started, rss_mib(), tracemalloc.get_traced_memory()[0] / 2**20,
                      snap.num_used_blocks, len(held), snap.num_running, snap.num_waiting, snap.num_requests)


def soak_engine(llm: LLM, num_requests: int, sample_every: int = 250, in_flight: int = 48, seed: int = 0,
                progress: bool = True) -> dict:
    """Send num_requests mixed requests through llm's engine, in_flight at a time; sample as it goes."""
    from tqdm.auto import tqdm

    rng, words = random.Random(seed), prompt_words()
    tracemalloc.start(1)
    started = time.perf_counter()
    live: dict[str, SoakRequest] = {}  # request id -> what was sent
    steps_left: dict[str, int] = {}  # requests to abort, and after how many more steps
    counts = {kind: 0 for kind in KINDS} | {"refused": 0, "finished": 0, "aborted": 0, "errors": 0, "tokens": 0}
    samples = [sample(llm, 0, started)]
    sent = 0
    bar = tqdm(total=num_requests, desc="soak", disable=not progress)
    while sent < num_requests or live:
        while sent < num_requests and len(live) < in_flight:
            request = random_request(rng, words)
            sent += 1
            counts[request.kind] += 1
            bar.update(1)
            try:
                request_id = llm.add_request(request.prompt, SamplingParams(**request.params))
                live[request_id] = request
                if request.kind == "abort":
                    steps_left[request_id] = request.abort_after_steps
            except ValueError:
                counts["refused"] += 1
            if sent % sample_every == 0:
                samples.append(sample(llm, sent, started))
        for output in llm.step():
            if output.finished:
                live.pop(output.request_id, None)
                steps_left.pop(output.request_id, None)
                counts["finished"] += 1
                counts["errors"] += sum(c.finish_reason == "error" for c in output.outputs)
                counts["tokens"] += sum(len(c.token_ids) for c in output.outputs)
        for request_id in list(steps_left):
            steps_left[request_id] -= 1
            if steps_left[request_id] <= 0:
                llm.abort_request(request_id)
                live.pop(request_id, None)
                del steps_left[request_id]
                counts["aborted"] += 1
    bar.close()
    final, final_counts = sample(llm, sent, started), llm.engine.snapshot()
    samples.append(final)
    tracemalloc.stop()
    expected_refusals = counts["invalid"]
    from minfer.lab.bench.common import machine_info

    return {
        "machine": machine_info(), "num_requests": sent, "counts": counts, "samples": [asdict(s) for s in samples],
        "seconds": final.seconds, "output_tokens_per_s": counts["tokens"] / final.seconds,
        "leaked_blocks": final.blocks_in_use, "requests_left": final.engine_requests + final.running + final.waiting,
        "max_block_discrepancy": max(s.blocks_in_use - s.blocks_held for s in samples),
        "refusals_as_expected": counts["refused"] == expected_refusals,
        "padding_fraction": final_counts.padding_tokens / max(1, final_counts.computed_tokens),
        "plateau": plateau(samples),
    }


def plateau(samples: list, warmup_fraction: float = 0.4, flat_from: int = 2000) -> dict:
    """Has memory stopped growing? From the samples alone.

    slope: RSS growth in MiB per 1,000 requests after the warm-up (the first warmup_fraction of
    the requests), by least squares. flat: the relative RSS change from the sample at flat_from
    requests (or the end of the warm-up, if the run is shorter) to the end. The targets: slope
    under 20 MiB per 1,000 requests, change within 5 %."""
    rows = [s if isinstance(s, dict) else asdict(s) for s in samples]
    last = rows[-1]["requests"]
    after = [r for r in rows if r["requests"] >= warmup_fraction * last]
    if len(after) < 3:
        return {"slope_mib_per_1000": None, "flat_change": None, "verdict": "too few samples to tell"}
    xs, ys = [r["requests"] for r in after], [r["rss_mib"] for r in after]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    start = next((r for r in rows if r["requests"] >= min(flat_from, warmup_fraction * last)), rows[0])
    flat_change = (rows[-1]["rss_mib"] - start["rss_mib"]) / start["rss_mib"]
    ok = slope < 20 and abs(flat_change) <= 0.05
    heap = [r["heap_mib"] for r in after if "heap_mib" in r]
    return {"slope_mib_per_1000": slope, "flat_change": flat_change, "flat_from_requests": start["requests"],
            "heap_growth_mib": heap[-1] - heap[0] if heap else None, "verdict": "plateaued" if ok else "still growing"}


# ---------------------------------------------------------------- what the buckets cost and save
def step_times(llm: LLM, requests: list[SoakRequest]) -> dict:
    """Run the (valid) requests through the engine, all queued at once; time every step.

    Process CPU time, not wall time: on a shared machine other work inflates the wall clock, not
    the CPU this process spends (run it with one torch thread)."""
    for r in requests:
        if r.kind != "invalid":
            llm.add_request(r.prompt, SamplingParams(**r.params))
    times, tokens = [], 0
    started = time.process_time()
    while llm.has_unfinished_requests():
        t = time.process_time()
        tokens += sum(1 for _ in llm.step())
        times.append(time.process_time() - t)
    total = time.process_time() - started
    times.sort()
    return {"cpu_s": total, "steps": len(times), "median_step_ms": 1e3 * times[len(times) // 2],
            "p99_step_ms": 1e3 * times[int(0.99 * (len(times) - 1))], "max_step_ms": 1e3 * times[-1]}


def bucket_ab(model: str, dtype: str, num_requests: int, rounds: int = 2, seed: int = 1) -> dict:
    """Buckets on against off, the same requests, alternating (on, off, on, off...) in one process.

    Each round uses new requests (new lengths, so new shapes for the unbucketed engine: the
    compiles a long-running server keeps meeting)."""
    rng, words = random.Random(seed), prompt_words()
    llms = {True: LLM(model, dtype=dtype, device="cpu"), False: LLM(model, dtype=dtype, device="cpu", bucket_step_shapes=False)}
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(rounds):
        requests = [random_request(rng, words) for _ in range(num_requests)]
        for bucketed in (True, False):
            runs[bucketed].append(step_times(llms[bucketed], requests))
    counts = llms[True].engine.snapshot()
    padding = counts.padding_tokens / counts.computed_tokens
    cpu = {b: sum(r["cpu_s"] for r in rs) for b, rs in runs.items()}
    return {"rounds": rounds, "requests_per_round": num_requests, "buckets": runs[True], "exact": runs[False],
            "cpu_ratio_exact_over_buckets": cpu[False] / cpu[True], "padding_fraction": padding}


# ---------------------------------------------------------------- through the HTTP server
def _send_over_http(client, request: SoakRequest, model: str, rng: random.Random) -> str:
    """Send one soak request with the openai client; returns what became of it."""
    import openai

    p = dict(request.params)
    extra = {k: p.pop(k) for k in ("top_k", "min_p") if k in p}
    logprobs = p.pop("logprobs", None)
    args = dict(model=model, prompt=request.prompt, extra_body=extra, logprobs=logprobs, **p)
    try:
        if request.kind == "abort":  # a client that reads a few tokens, then goes away
            stream = client.completions.create(**args, stream=True)
            for i, _ in enumerate(stream):
                if i + 1 >= request.abort_after_steps:
                    break
            stream.close()
            return "disconnected"
        if rng.random() < 0.5:
            for _ in client.completions.create(**args, stream=True):
                pass
        else:
            client.completions.create(**args)
        return "finished"
    except openai.BadRequestError:
        return "refused"


def soak_server(model: str, num_requests: int, sample_every: int = 250, concurrency: int = 24, seed: int = 0,
                dtype: str = "bfloat16", progress: bool = True) -> dict:
    """The same mix of requests through `python -m minfer serve`, from concurrent openai clients.

    Aborts become clients that disconnect mid-stream. Samples the server process's RSS and its
    /metrics (running, waiting, KV-cache use) every sample_every requests."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from tqdm.auto import tqdm

    from minfer.lab.bench.launch import free_port, launched_server, minfer_server_command

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rng, words = random.Random(seed), prompt_words()
    requests = [random_request(rng, words) for _ in range(num_requests)]
    outcomes = {"finished": 0, "refused": 0, "disconnected": 0, "failed": 0}
    samples = []
    with launched_server(minfer_server_command(model, port, "soak", dtype), url) as process:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
        started = time.perf_counter()

        def take_sample(done: int) -> None:
            m = server_metrics(url)
            samples.append({"requests": done, "seconds": time.perf_counter() - started, "rss_mib": rss_mib(process.pid),
                            "running": m["num_requests_running"], "waiting": m["num_requests_waiting"],
                            "kv_cache_usage": m["kv_cache_usage_perc"]})

        take_sample(0)
        with ThreadPoolExecutor(concurrency) as pool, tqdm(total=num_requests, desc="soak (server)", disable=not progress) as bar:
            futures = [pool.submit(_send_over_http, client, r, "soak", random.Random(seed + i)) for i, r in enumerate(requests)]
            for i, future in enumerate(futures, 1):
                try:
                    outcomes[future.result()] += 1
                except Exception:  # a 5xx or a dropped connection: counted, the soak goes on
                    outcomes["failed"] += 1
                bar.update(1)
                if i % sample_every == 0:
                    take_sample(i)
        deadline = time.monotonic() + 30  # disconnected requests are aborted within a step or two
        while time.monotonic() < deadline and server_metrics(url)["num_requests_running"] > 0:
            time.sleep(0.1)
        take_sample(num_requests)
        final = samples[-1]
    expected = sum(r.kind == "invalid" for r in requests)
    return {"num_requests": num_requests, "outcomes": outcomes, "samples": samples, "seconds": final["seconds"],
            "requests_left": final["running"] + final["waiting"], "kv_cache_usage_at_end": final["kv_cache_usage"],
            "refusals_as_expected": outcomes["refused"] == expected, "plateau": plateau(samples, flat_from=num_requests // 2)}


# ---------------------------------------------------------------- the command line
def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--sample-every", type=int, default=250)
    parser.add_argument("--in-flight", type=int, default=48, help="requests kept in flight (more than max_num_seqs: some wait)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-buckets", action="store_true", help="run every step at its exact size (bucket_step_shapes=False)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the result here")
    parser.add_argument("--server", action="store_true",
                        help="through `python -m minfer serve` with concurrent openai clients (aborts become disconnects)")
    parser.add_argument("--hostile", action="store_true",
                        help="with --server: ordinary clients beside hostile ones (degenerate settings, bursts, stalled "
                             "bodies, disconnects) for --seconds; checks answers, 5xx, leaks and /health latency")
    parser.add_argument("--seconds", type=float, default=90.0, help="how long the hostile soak runs")
    parser.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                        help="buckets on vs off on the same requests, ROUNDS alternations, process CPU time per step")
    parser.add_argument("--compare", action="store_true",
                        help="run every variant of DEFAULT_VARIANTS in its own process, one after another")
    parser.add_argument("--no-progress", action="store_true")


def run_soak(args: argparse.Namespace) -> int:
    for name in ("requests", "sample_every", "in_flight"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.ab:
        result = bucket_ab(args.model, args.dtype, args.requests, args.ab, args.seed)
        for name in ("buckets", "exact"):
            for r in result[name]:
                print(f"{name}: {r}")
        print(f"CPU time without buckets / with: {result['cpu_ratio_exact_over_buckets']:.3f}; "
              f"padding {100 * result['padding_fraction']:.1f} % of the rows")
    elif args.compare:
        result = compare_variants(args)
        print(format_table(result))
    elif args.server and args.hostile:
        result = hostile_soak(args.model, args.seconds, args.dtype, args.seed)
        print(format_hostile(result))
    elif args.server:
        result = soak_server(args.model, args.requests, args.sample_every, seed=args.seed, dtype=args.dtype,
                             progress=not args.no_progress)
        p = result["plateau"]
        print(f"{result['num_requests']} requests through the server in {result['seconds']:.0f} s: {result['outcomes']}; "
              f"left {result['requests_left']}, KV use at the end {result['kv_cache_usage_at_end']:.3f}; RSS slope "
              f"{p['slope_mib_per_1000']:.1f} MiB per 1000 requests: {p['verdict']}")
    else:
        llm = LLM(args.model, dtype=args.dtype, device="cpu", bucket_step_shapes=not args.no_buckets)
        result = soak_engine(llm, args.requests, args.sample_every, args.in_flight, args.seed, not args.no_progress)
        p = result["plateau"]
        print(f"{result['num_requests']} requests in {result['seconds']:.0f} s; leaked blocks {result['leaked_blocks']}, "
              f"requests left {result['requests_left']}; RSS slope {p['slope_mib_per_1000']:.1f} MiB per 1000 requests, "
              f"change {100 * p['flat_change']:+.1f} % since request {p['flat_from_requests']}: {p['verdict']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return 0


def compare_variants(args: argparse.Namespace, variants: dict = DEFAULT_VARIANTS) -> dict:
    """Each variant in a fresh process (native caches start empty), one after another, same requests."""
    import tempfile

    runs = {}
    for name, (engine_args, env) in variants.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "soak.json")
            cmd = [sys.executable, "-m", "minfer", "bench", "soak", "--model", args.model, "--dtype", args.dtype,
                   "--requests", str(args.requests), "--sample-every", str(args.sample_every),
                   "--in-flight", str(args.in_flight), "--seed", str(args.seed), "--json", out, "--no-progress"]
            if engine_args.get("bucket_step_shapes") is False:
                cmd.append("--no-buckets")
            print(f"soak: {name} ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, env={**os.environ, **env})
            runs[name] = json.loads(Path(out).read_text())
    return {"variants": runs, "args": {k: getattr(args, k) for k in ("model", "dtype", "requests", "sample_every", "in_flight", "seed")}}


def format_table(result: dict) -> str:
    lines = ["| variant | output tok/s | RSS start → end (MiB) | slope after warm-up (MiB / 1000 req) | change since flat point "
             "| Python heap growth (MiB) | leaked blocks | requests left | verdict |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for name, run in result["variants"].items():
        s, p = run["samples"], run["plateau"]
        lines.append(f"| {name} | {run['output_tokens_per_s']:.0f} | {s[1]['rss_mib']:.0f} → {s[-1]['rss_mib']:.0f} "
                     f"| {p['slope_mib_per_1000']:.1f} | {100 * p['flat_change']:+.1f} % (from request {p['flat_from_requests']}) "
                     f"| {p['heap_growth_mib']:+.2f} | {run['leaked_blocks']} | {run['requests_left']} | {p['verdict']} |")
    return "\n".join(lines)


def plot_variants(result: dict, path: Union[str, Path]) -> None:
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) stays as it is

    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for name, run in result["variants"].items():
        rows = run["samples"][1:]
        ax.plot([r["requests"] for r in rows], [r["rss_mib"] for r in rows], marker=".", label=name)
    ax.set_xlabel("requests sent")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title("Soak: resident memory over requests (SmolLM2-135M, CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
