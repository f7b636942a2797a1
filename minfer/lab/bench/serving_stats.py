"""A serving run's results as one row: throughput, TTFT and TPOT percentiles, and how busy the machine was.

TTFT counts from the moment a request is handed to the engine (for a batch run, all requests are handed
over at once, so TTFT includes queueing); TPOT is (last token time - first token time) / (tokens - 1) of
each request, as `minfer.lab.bench.decode_speed` times them.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(values: Sequence[Optional[float]]) -> dict:
    """mean, p50, p99 of the values that are not None (seconds)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    return {"mean": sum(vals) / len(vals), "p50": percentile(vals, 50), "p99": percentile(vals, 99)}


def load_average() -> Optional[float]:
    """The 1-minute load average (other work on the machine slows every phase it overlaps)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def request_rows(outputs) -> list[dict]:
    """{ttft, tpot, num_output_tokens} of each finished request, from the engine's own metrics."""
    return [{"ttft": o.metrics.ttft, "tpot": o.metrics.tpot, "num_output_tokens": o.metrics.num_output_tokens}
            for o in outputs]


def summarize(engine: str, per_request: Sequence[dict], wall_s: float, **extra) -> dict:
    """One row of the results: per_request holds {ttft, tpot, num_output_tokens} of every request."""
    tokens = sum(r["num_output_tokens"] for r in per_request)
    return {"engine": engine, "requests": len(per_request), "output_tokens": tokens, "wall_s": wall_s,
            "output_tokens_per_s": tokens / wall_s, "requests_per_s": len(per_request) / wall_s,
            "ttft": latency_stats([r["ttft"] for r in per_request]),
            "tpot": latency_stats([r["tpot"] for r in per_request]),
            "ttfts": [r["ttft"] for r in per_request], "load_1min_after": load_average(), **extra}
