"""The load generator (minfer/lab/bench/serve.py and the modules it uses): its formulas, and its client against a fake OpenAI server.

The fake server (`fake_app`) streams `max_tokens` chunks with a small sleep between them, as the
OpenAI API documents streamed completions; with `serial=True` it serves one request at a time, so
queueing shows up in TTFT. No test asserts a time, only ratios and orderings of times.
Run as a script (`python tests/test_bench_serve.py --port P`) it serves the fake app, so the
launching code can start and stop it as a subprocess.
"""
import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time

import numpy as np
import pytest

from minfer.lab.bench import latency, launch, loadgen, serve, serve_report
from minfer.models import loader

FAKE_MODEL = "fake-model"


# --------------------------------------------------------------------------- the fake server

def fake_app(token_delay: float = 0.005, first_delay: float = 0.0, serial: bool = False):
    """An OpenAI-compatible completions server that streams one word per token (and counts them in `usage`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    one_at_a_time = asyncio.Lock()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model", "owned_by": "test"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("model") != FAKE_MODEL:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found", "type": "NotFoundError",
                                           "param": "model", "code": 404}}, status_code=404)
        if "FAIL" in body["prompt"]:
            return JSONResponse({"error": {"message": "bad prompt", "type": "BadRequestError", "param": "prompt",
                                           "code": 400}}, status_code=400)
        n, prompt_tokens = body["max_tokens"], len(body["prompt"].split())
        usage = (body.get("stream_options") or {}).get("include_usage")

        async def events():
            async with one_at_a_time if serial else contextlib.nullcontext():
                await asyncio.sleep(first_delay)
                for i in range(n):
                    if i:
                        await asyncio.sleep(token_delay)
                    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": FAKE_MODEL,
                             "choices": [{"index": 0, "text": " w", "finish_reason": "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if usage:
                    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": FAKE_MODEL,
                             "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                      "total_tokens": prompt_tokens + n}}
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def serving(app):
    """Serve `app` with uvicorn in a thread on a free port; yields its base URL."""
    import uvicorn

    port = launch.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def fake_url():
    with serving(fake_app(token_delay=0.005)) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(random_tiny_dir):
    return loader.load_tokenizer(random_tiny_dir)


def specs(n: int, max_tokens: int = 8) -> list:
    return [loadgen.RequestSpec(f"prompt number {i}", 3, max_tokens) for i in range(n)]


def run(*args, **kwargs):
    kwargs.setdefault("progress", False)
    return asyncio.run(loadgen.run_load(*args, **kwargs))


# --------------------------------------------------------------------------- arrivals

def test_arrival_times_have_the_asked_rate_and_spread():
    for burstiness in (0.25, 1.0, 4.0):
        times = loadgen.arrival_times(20001, request_rate=4.0, burstiness=burstiness, seed=3)
        gaps = np.diff(times)
        assert times[0] == 0.0 and np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(0.25, rel=0.05)  # mean gap 1 / rate, whatever the burstiness
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)  # CV = 1/sqrt(k)
    assert loadgen.arrival_times(50, 2.0, seed=1) == loadgen.arrival_times(50, 2.0, seed=1)
    assert loadgen.arrival_times(50, 2.0, seed=1) != loadgen.arrival_times(50, 2.0, seed=2)
    assert loadgen.arrival_times(5, math.inf) == [0.0] * 5
    assert loadgen.arrival_times(0, 1.0) == []


@pytest.mark.parametrize("rate, burstiness", [(0, 1), (-1, 1), (float("nan"), 1), (1, 0), (1, -2), (1, math.inf)])
def test_arrival_times_refuse_bad_values(rate, burstiness):
    with pytest.raises(ValueError, match="rate|burstiness"):
        loadgen.arrival_times(3, rate, burstiness)


# --------------------------------------------------------------------------- statistics

def test_latency_summary_is_numpy_in_ms():
    values = [0.12, 0.05, 0.3, 0.07, 0.5, 0.11, 0.09]
    s = latency.latency_summary(values, "ttft")
    ms = np.array(values) * 1000
    assert s["mean_ttft_ms"] == pytest.approx(ms.mean())
    assert s["median_ttft_ms"] == pytest.approx(np.median(ms))
    assert s["std_ttft_ms"] == pytest.approx(ms.std())
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile(ms, 90))
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(ms, 99))
    assert all(v is None for v in latency.latency_summary([], "itl").values())


def test_time_per_output_token():
    assert latency.time_per_output_token(latency=2.0, ttft=0.5, output_len=11) == pytest.approx(0.15)
    assert latency.time_per_output_token(1.0, 0.5, 1) is None


def test_parse_goodput():
    assert latency.parse_goodput(["ttft:2000", "tpot:100.5"]) == {"ttft": 2000.0, "tpot": 100.5}
    assert latency.parse_goodput(["ttft:2000,e2el:9000"]) == {"ttft": 2000.0, "e2el": 9000.0}
    assert latency.parse_goodput(None) == {}
    with pytest.raises(ValueError, match="unknown SLO metric 'itl'.*ttft, tpot, e2el"):
        latency.parse_goodput(["itl:50"])
    for bad in ("ttft", "ttft:", ":100", "ttft=100"):
        with pytest.raises(ValueError, match="malformed"):
            latency.parse_goodput([bad])
    for bad in ("ttft:abc", "ttft:0", "ttft:-5", "ttft:inf"):
        with pytest.raises(ValueError, match="ttft"):
            latency.parse_goodput([bad])


def result(ttft, latency, output_len, success=True, itl=()):
    return loadgen.RequestResult(success=success, prompt_len=10, output_len=output_len, ttft=ttft, latency=latency,
                                 itl=list(itl), error="" if success else "boom")


def test_meets_slos_and_goodput():
    fast = result(0.1, 1.0, 10)  # TPOT 0.1 s
    slow_start = result(3.0, 4.0, 10)
    slow_tokens = result(0.1, 10.0, 10)  # TPOT 1.1 s
    single = result(0.1, 0.1, 1)  # no TPOT at all
    failed = result(None, None, 0, success=False)
    slos = {"ttft": 2000.0, "tpot": 200.0}
    assert [latency.meets_slos(r, slos) for r in (fast, slow_start, slow_tokens, single, failed)] == \
        [True, False, False, True, False]
    assert latency.meets_slos(slow_tokens, {"ttft": 2000.0})
    assert not latency.meets_slos(slow_tokens, {"e2el": 5000.0})
    assert latency.request_goodput([fast, slow_start, slow_tokens, single, failed], slos, duration_s=4.0) == 0.5


def test_summarize_results_uses_vllms_names():
    rs = [result(0.2, 1.1, 10, itl=[0.1] * 9), result(0.4, 2.4, 21, itl=[0.1] * 20),
          loadgen.RequestResult(prompt_len=7, error="HTTP 503")]
    s = latency.summarize_results(rs, 4.0, {"ttft": 300.0}, request_rate=2.0)
    for key in ("completed", "total_input_tokens", "total_output_tokens", "duration", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput", "ttfts", "itls", "input_lens",
                "output_lens", "errors", "request_rate"):
        assert key in s
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in s
    assert s["completed"] == 2 and s["failed"] == 1 and s["num_prompts"] == 3
    assert s["total_input_tokens"] == 20 and s["total_output_tokens"] == 31  # failed requests count no tokens
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == 31 / 4
    assert s["total_token_throughput"] == 51 / 4
    assert s["request_goodput"] == 0.25  # only the first met TTFT <= 300 ms
    assert s["mean_ttft_ms"] == pytest.approx(300.0)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)  # (1.1 - 0.2) / 9 and (2.4 - 0.4) / 20
    assert s["median_itl_ms"] == pytest.approx(100.0) and len([g for r in s["itls"] for g in r]) == 29
    assert s["mean_e2el_ms"] == pytest.approx(1750.0)
    assert s["ttfts"] == [0.2, 0.4, None] and s["errors"] == ["", "", "HTTP 503"]
    assert latency.summarize_results(rs, 4.0)["request_goodput"] is None  # no SLO, no goodput (as vLLM)
    json.dumps(s)  # the summary is JSON as it is


def sweep_run(rate, p99_ttft_ms, goodput, failed=0):
    return {"request_rate": rate, "p99_ttft_ms": p99_ttft_ms, "request_goodput": goodput,
            "request_throughput": goodput, "failed": failed}


def test_sustainable_rate_and_knee():
    runs = [sweep_run(0.5, 300, 0.5), sweep_run(1, 600, 0.98), sweep_run(2, 1900, 1.6),
            sweep_run(4, 9000, 1.2)]
    assert latency.sustainable_rate(runs, 2000) == 2
    assert latency.sustainable_rate(runs, 500) == 0.5
    assert latency.sustainable_rate(runs, 100) is None
    runs[2]["failed"] = 1  # a rate that lost a request is not sustainable
    assert latency.sustainable_rate(runs, 2000) == 1
    assert latency.find_knee(runs) == 2  # the best goodput
    plateau = [sweep_run(1, 0, 1.0), sweep_run(2, 0, 1.9), sweep_run(4, 0, 2.0), sweep_run(8, 0, 1.98)]
    assert latency.find_knee(plateau) == 2  # 1.9 is within 5% of the best 2.0: more load bought too little
    assert latency.find_knee([]) is None
    never_in_time = [{"request_rate": r, "request_goodput": 0.0, "request_throughput": r} for r in (0.5, 1, 2)]
    assert latency.find_knee(never_in_time) is None  # no rate served anything within the SLOs: no knee


def test_past_knee():
    assert not latency.past_knee({"failed": 0, "median_ttft_ms": 1900.0}, 2000)
    assert latency.past_knee({"failed": 0, "median_ttft_ms": 2100.0}, 2000)
    assert latency.past_knee({"failed": 1, "median_ttft_ms": 10.0}, 2000)
    assert latency.past_knee({"failed": 3, "median_ttft_ms": None}, 2000)


def test_a_sweep_stops_past_the_knee(tokenizer):
    args = parse("--num-prompts", "4", "--input-len", "4:8", "--output-len", "2:4", "--disable-tqdm")
    with serving(fake_app(first_delay=0.05)) as url:  # every TTFT >= 50 ms
        missed = serve.measure_server(url, FAKE_MODEL, tokenizer, args, "fake", [1000.0, 2000.0, math.inf], {"ttft": 10.0})
        met = serve.measure_server(url, FAKE_MODEL, tokenizer, args, "fake", [1000.0, 2000.0], {"ttft": 10000.0})
    assert [r["request_rate"] for r in missed["runs"]] == [1000.0] and missed["rates_skipped"] == [2000.0, math.inf]
    assert missed["sustainable_rate"] is None and missed["knee_rate"] is None and missed["max_goodput"] == 0.0
    assert [r["request_rate"] for r in met["runs"]] == [1000.0, 2000.0] and met["sustainable_rate"] == 2000.0


def test_ratios_of_sustainable_rates():
    def server(name, sustainable, rates=(0.25, 0.5, 1, 2)):
        return {"name": name, "sustainable_rate": sustainable, "runs": [{"request_rate": r} for r in rates]}

    r = serve_report.ratios([server("minfer", 2.0), server("minfer-seq", 0.25)])
    assert r == {"minfer_vs_one_at_a_time": 8.0, "minfer_vs_one_at_a_time_is_lower_bound": False}
    r = serve_report.ratios([server("minfer", 2.0), server("minfer-seq", None)])  # below 0.25: the ratio is at least 8
    assert r == {"minfer_vs_one_at_a_time": 8.0, "minfer_vs_one_at_a_time_is_lower_bound": True}
    assert serve_report.ratios([server("minfer", None), server("minfer-seq", 0.5)])["minfer_vs_one_at_a_time"] is None
    assert serve_report.ratios([server("minfer", math.inf), server("minfer-seq", 1.0)])["minfer_vs_one_at_a_time"] is None
    assert serve_report.ratios([server("minfer", 2.0)]) == {}


def test_rates_ranges_and_prompts_per_rate():
    assert serve.parse_rates("2,0.5, 1,inf,1") == [0.5, 1.0, 2.0, math.inf]
    for bad in ("", "a,b", "1,0", "-1"):
        with pytest.raises(ValueError, match="rate|--sweep"):
            serve.parse_rates(bad)
    assert serve.parse_range("32:256", "--input-len") == (32, 256) and serve.parse_range("64", "x") == (64, 64)
    for bad in ("0:5", "9:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--input-len"):
            serve.parse_range(bad, "--input-len")
    assert latency.prompts_for_rate(0.1, 64, None) == 64
    assert latency.prompts_for_rate(0.1, 64, 60) == latency.MIN_SWEEP_PROMPTS
    assert latency.prompts_for_rate(0.5, 64, 60) == 30
    assert latency.prompts_for_rate(4, 64, 60) == 64
    assert latency.prompts_for_rate(math.inf, 64, 60) == 64


def test_check_loopback():
    assert loadgen.check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert loadgen.check_loopback("http://localhost:1") == "http://localhost:1"
    for bad in ("http://example.com:8000", "http://10.0.0.1", "ftp://127.0.0.1", "127.0.0.1:8000"):
        with pytest.raises(ValueError, match="127.0.0.1, localhost"):
            loadgen.check_loopback(bad)


# --------------------------------------------------------------------------- the workload

def test_sample_requests_from_the_python_docs(tokenizer):
    a = loadgen.sample_requests(tokenizer, 30, (5, 40), (2, 64), seed=4)
    assert a == loadgen.sample_requests(tokenizer, 30, (5, 40), (2, 64), seed=4)
    assert a != loadgen.sample_requests(tokenizer, 30, (5, 40), (2, 64), seed=5)
    assert all(5 <= r.prompt_len <= 40 and 2 <= r.max_tokens <= 64 for r in a)
    assert all(len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in a)
    lens = sorted(r.max_tokens for r in a)
    assert lens[len(lens) // 2] < 32  # log-uniform: the median sits well below the middle of the range
    assert max(lens) > 32  # and the tail is there
    uniform = loadgen.sample_requests(tokenizer, 30, (5, 40), (2, 64), output_dist="uniform", seed=4)
    assert statistics.mean(r.max_tokens for r in uniform) > statistics.mean(lens)


# --------------------------------------------------------------------------- the client against the fake

def test_run_load_measures_every_request(fake_url):
    results, duration = run(fake_url, FAKE_MODEL, specs(6, max_tokens=12), math.inf)
    assert all(r.success for r in results), [r.error for r in results]
    for r in results:
        assert r.output_len == 12 and r.usage and r.prompt_len == 3  # the server's own counts
        assert len(r.itl) == 11 and r.generated_text == " w" * 12
        assert 0 < r.ttft <= r.latency <= duration
        assert r.latency == pytest.approx(r.ttft + sum(r.itl))
        assert statistics.median(r.itl) >= 0.9 * 0.005  # the fake sleeps 5 ms between tokens
    s = latency.summarize_results(results, duration)
    assert s["median_itl_ms"] >= 0.9 * 5 and s["mean_tpot_ms"] == pytest.approx(s["mean_itl_ms"], rel=1e-6)


def test_arrivals_spread_requests_out(fake_url):
    rate = 20.0
    results, duration = run(fake_url, FAKE_MODEL, specs(10, max_tokens=2), rate, seed=7)
    starts = [r.start_time for r in results]
    planned = loadgen.arrival_times(10, rate, seed=7)
    assert starts == sorted(starts)
    assert starts[-1] >= 0.9 * planned[-1]  # sent no earlier than planned
    burst, _ = run(fake_url, FAKE_MODEL, specs(10, max_tokens=2), math.inf)
    assert max(r.start_time for r in burst) < starts[-1]


def test_a_one_at_a_time_server_shows_queueing_in_ttft():
    n = 4
    # 0.57 s of streaming per request: the serial server's last TTFT (~1.7 s) stays far above the hiccups of
    # a busy machine (a concurrent TTFT of 0.35 s was seen while the rest of the suite ran beside this test)
    with serving(fake_app(token_delay=0.03, serial=True)) as url:
        serial, _ = run(url, FAKE_MODEL, specs(n, max_tokens=20), math.inf)
    with serving(fake_app(token_delay=0.03)) as url:
        concurrent, _ = run(url, FAKE_MODEL, specs(n, max_tokens=20), math.inf)
    ttft_serial = sorted(r.ttft for r in serial)
    ttft_concurrent = sorted(r.ttft for r in concurrent)
    service = min(r.latency for r in serial)  # one request's whole stream
    # the last one waited for the three before it: measured 0.98 of three streams, asserted a third of that
    assert ttft_serial[-1] >= (n - 1) * service / 3
    assert ttft_serial[-1] > 1.5 * ttft_concurrent[-1]  # measured 185x, 4.9x at worst beside the suite


def test_max_concurrency_caps_requests_in_flight(fake_url):
    results, _ = run(fake_url, FAKE_MODEL, specs(4, max_tokens=10), math.inf, max_concurrency=1)
    assert all(r.success for r in results)
    ordered = sorted(results, key=lambda r: r.start_time)
    for before, after in zip(ordered, ordered[1:]):
        assert after.start_time >= before.start_time + 0.9 * before.latency  # sent only when the one before ended


def test_errors_are_recorded_not_raised(fake_url):
    bad = [loadgen.RequestSpec("this will FAIL", 3, 4), loadgen.RequestSpec("fine", 1, 4)]
    results, _ = run(fake_url, FAKE_MODEL, bad, math.inf)
    assert not results[0].success and "HTTP 400" in results[0].error and "bad prompt" in results[0].error
    assert results[1].success
    wrong_model, _ = run(fake_url, "no-such-model", specs(1), math.inf)
    assert "HTTP 404" in wrong_model[0].error
    nobody, _ = run(f"http://127.0.0.1:{launch.free_port()}", FAKE_MODEL, specs(1), math.inf)
    assert not nobody[0].success and "Connect" in nobody[0].error
    s = latency.summarize_results(results, 1.0, {"ttft": 10000.0})
    assert s["completed"] == 1 and s["failed"] == 1 and s["request_goodput"] == 1.0


def test_a_run_stops_at_max_duration():
    with serving(fake_app(token_delay=0.5)) as url:
        start = time.perf_counter()
        finished, _ = run(url, FAKE_MODEL, specs(3, max_tokens=2), math.inf)  # 0.5 s of streaming each
        whole = time.perf_counter() - start
        start = time.perf_counter()
        results, duration = run(url, FAKE_MODEL, specs(3, max_tokens=100), math.inf, max_duration_s=0.5)
        elapsed = time.perf_counter() - start
    assert all(r.success for r in finished)
    # cut off after 0.5 s, as long as the 0.5 s requests took (measured ~1x): nowhere near the 50 s these would take
    assert duration < elapsed < 4 * whole, (elapsed, whole)
    assert not any(r.success for r in results)
    assert all("max-duration" in r.error for r in results)


def test_max_duration_counts_from_the_last_request_sent(fake_url):
    rate = 10.0  # the last of 6 requests is sent about 0.5 s after the first, later than max_duration_s
    results, duration = run(fake_url, FAKE_MODEL, specs(6, max_tokens=2), rate, seed=1, max_duration_s=0.3)
    assert loadgen.arrival_times(6, rate, seed=1)[-1] > 0.3
    assert all(r.success for r in results), [r.error for r in results]


def test_run_load_refuses_a_remote_server():
    with pytest.raises(ValueError, match="127.0.0.1"):
        run("http://example.com", FAKE_MODEL, specs(1), math.inf)


# --------------------------------------------------------------------------- the command line

def parse(*argv):
    parser = argparse.ArgumentParser(prog="minfer bench serve")
    serve.add_serve_bench_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "0"], "request rate must be > 0"),
    (["--request-rate", "-3"], "request rate must be > 0"),
    (["--request-rate", "fast"], "request rate must be a number > 0 or inf"),
    (["--goodput", "latency:100"], "unknown SLO metric 'latency' in --goodput: use ttft, tpot, e2el"),
    (["--goodput", "ttft"], "malformed --goodput item 'ttft'"),
    (["--goodput", "ttft:-1"], "positive number of milliseconds"),
    (["--sweep", "1,0"], "request rate must be > 0"),
    (["--input-len", "50:10"], "--input-len needs 1 <= LO <= HI"),
    (["--num-prompts", "0"], "must be > 0"),
    (["--burstiness", "0"], "must be > 0"),
])
def test_bad_arguments_get_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_check_args_names_what_is_allowed():
    with pytest.raises(ValueError, match="unknown server.*use minfer, minfer-seq, llama-cpp"):
        serve.check_args(parse("--launch", "--servers", "minfer,vllm"))
    with pytest.raises(ValueError, match="not both"):
        serve.check_args(parse("--launch", "--base-url", "http://127.0.0.1:8000"))
    with pytest.raises(ValueError, match="loopback|127.0.0.1"):
        serve.check_args(parse("--base-url", "http://192.168.1.1:8000"))
    assert serve.check_args(parse("--goodput", "ttft:100", "tpot:5")) == {"ttft": 100.0, "tpot": 5.0}


def test_run_serve_bench_sweeps_a_running_server(fake_url, random_tiny_dir, tmp_path, capsys):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Another section\n\nkept\n")
    args = parse("--base-url", fake_url, "--tokenizer", random_tiny_dir, "--sweep", "inf,50,100",
                 "--num-prompts", "6", "--input-len", "4:20", "--output-len", "2:16", "--goodput", "ttft:10000",
                 "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"), "--update-docs", str(docs),
                 "--disable-tqdm")
    assert serve.run_serve_bench(args) == 0
    out = capsys.readouterr().out
    assert f"| {FAKE_MODEL} | 50 |" in out and "| inf |" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    (server,) = saved["servers"]
    assert [r["request_rate"] for r in server["runs"]] == [50, 100, math.inf]
    assert all(r["completed"] == 6 for r in server["runs"])
    assert server["sustainable_rate"] == math.inf and server["model_id"] == FAKE_MODEL
    run0 = server["runs"][0]
    assert sum(run0["output_lens"]) == run0["total_output_tokens"] and len(run0["ttfts"]) == 6
    assert (tmp_path / "r.png").stat().st_size > 10_000
    text = docs.read_text()
    assert serve_report.DOCS_START in text and serve_report.DOCS_END in text and "kept" in text
    assert "| fake-model | 100 | 6/6 |" in text
    # a rerun replaces the section, it does not append a second one
    serve.run_serve_bench(parse("--render", str(tmp_path / "r.json"), "--update-docs", str(docs)))
    assert docs.read_text().count(serve_report.DOCS_START) == 1


# --------------------------------------------------------------------------- servers started as subprocesses

def test_launched_server_starts_answers_and_stops(tmp_path):
    port = launch.free_port()
    url = f"http://127.0.0.1:{port}"
    with launch.launched_server([sys.executable, __file__, "--port", str(port)], url, startup_timeout_s=60,
                            log_path=tmp_path / "log") as process:
        assert launch.served_models(url) == [FAKE_MODEL]
        results, _ = run(url, FAKE_MODEL, specs(2), math.inf)
        assert all(r.success for r in results)
    assert process.poll() is not None  # stopped on the way out
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*going away"):
        with launch.launched_server([sys.executable, "-c", "print('going away'); raise SystemExit(3)"], url,
                                startup_timeout_s=30, log_path=tmp_path / "log2"):
            pass
    with pytest.raises(RuntimeError, match="not ready within 1 s"):
        with launch.launched_server([sys.executable, "-c", "import time; time.sleep(60)"], url, startup_timeout_s=1,
                                log_path=tmp_path / "log3") as process:
            pass
    # without a log_path the log is a temporary file, named in the error and not left open
    open_files = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*minfer_bench_serve_.*going away"):
            with launch.launched_server([sys.executable, "-c", "print('going away'); raise SystemExit(3)"], url,
                                        startup_timeout_s=30):
                pass
    if open_files is not None:
        assert len(os.listdir("/proc/self/fd")) == open_files


def test_server_commands():
    args = parse("--launch", "--dtype", "float32", "--max-num-seqs", "8", "--server-arg=--max-model-len 512")
    cmd = serve.server_command("minfer", args, "smollm2-135m", 1234, "smollm2-135m")
    assert cmd[1:5] == ["-m", "minfer", "serve", "smollm2-135m"]
    assert cmd[cmd.index("--port") + 1] == "1234" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "8" and cmd[-2:] == ["--max-model-len", "512"]
    seq = serve.server_command("minfer-seq", args, "smollm2-135m", 1234, "smollm2-135m")
    assert seq[seq.index("--max-num-seqs") + 1] == "1" and seq.count("--max-num-seqs") == 1
    assert serve.server_env(parse("--server-threads", "2"))["OMP_NUM_THREADS"] == "2"


@pytest.mark.slow
def test_launch_mode_against_the_real_minfer_server(random_tiny_dir, tmp_path):
    """Both minfer servers started by --launch on a tiny random model; every request gets exactly its tokens,
    and all-at-once traffic queues on the one-at-a-time server only."""
    args = parse("--launch", "--model", random_tiny_dir, "--dtype", "float32", "--servers", "minfer,minfer-seq",
                 "--sweep", "inf", "--num-prompts", "8", "--input-len", "8:40", "--output-len", "16:48",
                 "--temperature", "1", "--server-threads", "1", "--startup-timeout", "120",
                 "--json", str(tmp_path / "r.json"), "--disable-tqdm")
    assert serve.run_serve_bench(args) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    by = {s["name"]: s for s in saved["servers"]}
    assert set(by) == {"minfer", "minfer-seq"}
    wanted = [r.max_tokens for r in loadgen.sample_requests(loader.load_tokenizer(random_tiny_dir), 8, (8, 40), (16, 48),
                                                        seed=0)]
    for server in by.values():
        (run0,) = server["runs"]
        assert run0["completed"] == 8, run0["errors"]
        assert run0["output_lens"] == wanted  # ignore_eos: the server generated exactly max_tokens
        assert all(0 < len(itl) < n for itl, n in zip(run0["itls"], wanted))  # streamed, at most a chunk per token
    # all at once: one at a time, the last request waits for the 7 before it; batched, every one starts at once
    seq, cont = max(by["minfer-seq"]["runs"][0]["ttfts"]), max(by["minfer"]["runs"][0]["ttfts"])
    assert seq > 2 * cont


if __name__ == "__main__":  # the fake server as a process of its own, for test_launched_server_starts_answers_and_stops
    import uvicorn

    cli = argparse.ArgumentParser()
    cli.add_argument("--port", type=int, required=True)
    uvicorn.run(fake_app(), host="127.0.0.1", port=cli.parse_args().port, log_level="warning")
