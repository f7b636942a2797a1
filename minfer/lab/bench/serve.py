"""`python -m minfer bench serve`: load-test OpenAI-compatible servers, in the spirit of `vllm bench serve`.

    python -m minfer bench serve --base-url http://127.0.0.1:8000 --request-rate 2 --num-prompts 64
    python -m minfer bench serve --base-url http://127.0.0.1:8000 --sweep 0.5,1,2,4 --goodput ttft:2000
    python -m minfer bench serve --launch --sweep 0.125,0.25,0.5,1,2 --goodput ttft:2000   # starts the servers itself

The command line and the order of work; the pieces live beside it:

* `minfer.lab.bench.loadgen`: arrivals, the workload, one streamed request, one run;
* `minfer.lab.bench.latency`: TPOT, the summary with vLLM's field names, goodput, the knee, the sustainable rate;
* `minfer.lab.bench.launch`: servers started here (`--launch`), one after another on free local ports;
* `minfer.lab.bench.serve_report`: the table, the ratios against the targets, the plot, the JSON.

A sweep runs the rates in increasing order and stops after the first rate clearly past the knee.
Every request goes to a loopback address; every run is bounded in requests (`--num-prompts`) and in
wall time (`--max-duration`), and stops by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from minfer.lab.bench.common import add_update_docs_argument, machine_info
from minfer.lab.bench.latency import (DEFAULT_TTFT_SLO_MS, MIN_SWEEP_PROMPTS, SLO_METRICS, find_knee, parse_goodput,
                                  past_knee, prompts_for_rate, summarize_results, sustainable_rate)
from minfer.lab.bench.launch import free_port, launched_server, llama_cpp_server_command, minfer_server_command, served_models
from minfer.lab.bench.loadgen import RequestSpec, check_loopback, check_rate, run_load, sample_requests
from minfer.lab.bench.serve_report import num_text, ratios, report
from minfer.models.loader import load_tokenizer

DEFAULT_MODEL = "smollm2-135m"
SERVERS = ("minfer", "minfer-seq", "llama-cpp")
SERVER_LABELS = {"minfer": "minfer (continuous batching)", "minfer-seq": "minfer --max-num-seqs 1 (one at a time)",
                 "llama-cpp": "llama.cpp server (llama-cpp-python)"}


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
                  f"{duration:.1f} s, p99 TTFT {num_text(run['p99_ttft_ms'])} ms, {run['output_throughput']:.1f} output tok/s",
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
    add_update_docs_argument(o, docs_page)
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
