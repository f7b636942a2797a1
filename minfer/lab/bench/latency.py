"""Latency statistics of a load run, and of a sweep over request rates (vLLM's field names).

* TPOT (`time_per_output_token`) = (E2EL - TTFT) / (output tokens - 1): the time after the first
  token, shared among the others.
* The summary (`summarize_results`): mean, median, p90, p99 of TTFT, TPOT, ITL and E2EL in ms,
  request and token throughput, and goodput (`request_goodput`): requests per second that met
  every SLO given with `--goodput ttft:MS tpot:MS e2el:MS`. Field names are vLLM's, so the same
  plotting code reads both tools' JSON.
* A sweep over request rates: the latency-throughput curve, its knee (`find_knee`) and the
  sustainable request rate (`sustainable_rate`: the highest swept rate whose p99 TTFT meets the
  TTFT SLO).

One small public function per formula: chapter 09 imports and plots them.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

from minfer.lab.bench.loadgen import RequestResult
from minfer.lab.bench.serving_stats import percentile

SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may constrain (vLLM's keys), in ms
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)  # reported beside mean and median
DEFAULT_TTFT_SLO_MS = 2000.0  # a sweep's sustainable rate: p99 TTFT within 2 s, unless --goodput says otherwise
KNEE_TOLERANCE = 0.05  # the knee: the lowest rate whose goodput is within 5% of the sweep's best
MIN_SWEEP_PROMPTS = 16  # with --sweep-duration: never fewer requests than this at one rate


# --------------------------------------------------------------------------- one request

def time_per_output_token(latency: float, ttft: float, output_len: int) -> Optional[float]:
    """TPOT: the time after the first token, shared among the other output tokens; None with fewer than 2."""
    if output_len < 2:
        return None
    return (latency - ttft) / (output_len - 1)


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Did this request meet every given SLO? A failed request meets none; a request of one output token
    has no TPOT and so cannot miss a TPOT SLO."""
    if not result.success:
        return False
    values_ms = {"ttft": result.ttft * 1000.0, "e2el": result.latency * 1000.0}
    tpot = time_per_output_token(result.latency, result.ttft, result.output_len)
    values_ms["tpot"] = 0.0 if tpot is None else tpot * 1000.0
    return all(values_ms[key] <= limit for key, limit in slos_ms.items())


# --------------------------------------------------------------------------- one run

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
    If the best goodput is at the highest rate swept, the knee may lie beyond the sweep. None when no run served
    anything within its SLOs: such a sweep has no knee, only a server that was never in time."""
    points = sorted((run["request_rate"], run["request_goodput"] if run["request_goodput"] is not None
                     else run["request_throughput"]) for run in runs)
    best = max((g for _, g in points), default=0.0)
    if best <= 0:
        return None
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
