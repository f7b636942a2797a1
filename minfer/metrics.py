"""The engine's metrics as vLLM's `LLM.get_metrics()` returns them: a list of named values.

    for m in llm.get_metrics():
        if m.name == "minfer:spec_decode_num_accepted_tokens_per_pos":
            print(m.values)                  # accepted draft tokens at draft position 0, 1, ...

The record types and the names are vLLM's (its `vllm.v1.metrics.reader`), with the `minfer:`
prefix in place of `vllm:`, the same names `GET /metrics` serves. The values come from one engine
snapshot, so they agree with each other. What is here: the queues, the KV pool and the prefix
cache (gauges), preemptions and, with speculative decoding, the draft counts (counters, and one
vector by draft position).
"""
from __future__ import annotations

from dataclasses import dataclass

from minfer.engine.snapshot import EngineSnapshot

PREFIX = "minfer:"


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int  # only grows while the engine lives


@dataclass
class Gauge(Metric):
    value: float  # the state at the snapshot


@dataclass
class Vector(Metric):
    values: list[int]  # a counter per position


def engine_metrics(snap: EngineSnapshot, labels: dict[str, str]) -> list[Metric]:
    """The gauges, counters and vectors one snapshot holds, named as vLLM names them."""
    def named(kind, name: str, value) -> Metric:
        return kind(PREFIX + name, dict(labels), value)

    metrics = [named(Gauge, "num_requests_running", snap.num_running),
               named(Gauge, "num_requests_waiting", snap.num_waiting),
               named(Gauge, "kv_cache_usage_perc", snap.kv_cache_usage),
               named(Gauge, "gpu_prefix_cache_hit_rate", snap.prefix_hit_rate),
               named(Counter, "num_preemptions", snap.num_preemptions)]
    spec = snap.spec_decode
    if spec is not None:
        metrics += [named(Counter, "spec_decode_num_drafts", spec.num_drafts),
                    named(Counter, "spec_decode_num_draft_tokens", spec.num_draft_tokens),
                    named(Counter, "spec_decode_num_accepted_tokens", spec.num_accepted_tokens),
                    named(Vector, "spec_decode_num_accepted_tokens_per_pos", list(spec.num_accepted_tokens_per_pos))]
    return metrics
