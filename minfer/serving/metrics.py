"""What `GET /metrics` shows: the server's state and latencies, in Prometheus text format.

The names are vLLM's with a `minfer:` prefix (vLLM's `vllm:num_requests_running` is
`minfer:num_requests_running` here), so a dashboard made for one reads the other by changing
the prefix. Gauges are read from the engine when scraped; counters and histograms are fed by
every output the async engine routes (`ServerMetrics.observe`).
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily

from minfer.metrics import PREFIX, Gauge as GaugeValue, Vector, engine_metrics
from minfer.outputs import RequestOutput

disable_created_metrics()  # no `_created` twin beside every counter: less to read, as in vLLM
# vLLM's buckets for the same histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


@dataclass
class _Seen:
    tokens: int = 0  # output tokens over all n completions, as of the last output
    last_time: float = 0.0  # when the last new token was routed


COUNTER_HELP = {"num_preemptions": "Sequences preempted (their blocks freed, to be recomputed).",
                "spec_decode_num_drafts": "Verification passes that checked draft tokens.",
                "spec_decode_num_draft_tokens": "Draft tokens proposed.",
                "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
                "spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted, by position in the draft."}


class EngineCounters:
    """Counters the engine keeps itself (`minfer.metrics`), read from its latest snapshot when scraped (a
    Prometheus collector); a vector becomes one counter per position, labelled `position`, as in vLLM."""

    def __init__(self, async_engine, labels: dict[str, str]) -> None:
        self.async_engine, self.labels = async_engine, labels

    def collect(self):
        for m in engine_metrics(self.async_engine.snapshot, self.labels):
            if isinstance(m, GaugeValue):
                continue  # ServerMetrics reads the gauges live, from the async engine
            doc, labels = COUNTER_HELP[m.name.removeprefix(PREFIX)], list(m.labels.values())
            if isinstance(m, Vector):
                family = CounterMetricFamily(m.name, doc, labels=[*m.labels, "position"])
                for position, value in enumerate(m.values):
                    family.add_metric([*labels, str(position)], value)
            else:
                family = CounterMetricFamily(m.name, doc, labels=list(m.labels))
                family.add_metric(labels, m.value)
            yield family


class ServerMetrics:
    """The Prometheus metrics of one server, in a registry of their own (a test can run several servers)."""

    def __init__(self, async_engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, read) -> None:
            g = Gauge(PREFIX + name, doc, list(labels), registry=self.registry)
            g.labels(**labels).set_function(read)

        gauge("num_requests_running", "Sequences in the running batch.", lambda: async_engine.num_running)
        gauge("num_requests_waiting", "Sequences waiting for a place in the batch.", lambda: async_engine.num_waiting)
        gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
              lambda: async_engine.snapshot.kv_cache_usage)
        gauge("gpu_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens admitted.",
              lambda: async_engine.snapshot.prefix_hit_rate)
        self.registry.register(EngineCounters(async_engine, labels))

        def counter(name: str, doc: str, extra: tuple = ()) -> Counter:
            made = Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)
            if not extra:
                made.labels(**labels)  # shown as 0 from the start, not only after the first request
            return made

        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that produced a first token.")
        self._generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = counter("request_success", "Requests finished, by finish reason.", ("finished_reason",))

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, list(labels), buckets=buckets, registry=self.registry)

        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Time between two output tokens.", ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self._labels = labels
        self._seen: dict[str, _Seen] = {}

    def observe(self, output: RequestOutput, now: float) -> None:
        """Count what one routed output brought: new tokens, a first token, a finished request."""
        seen = self._seen.setdefault(output.request_id, _Seen())
        tokens = sum(len(c.token_ids) for c in output.outputs)
        new = tokens - seen.tokens
        m = output.metrics
        if seen.tokens == 0 and new > 0:
            self._prompt_tokens.labels(**self._labels).inc(len(output.prompt_token_ids))
            self._ttft.labels(**self._labels).observe(now - m.arrival_time)
        elif new > 0:  # several tokens in one step (speculative decoding, n > 1): the gap is shared out
            for _ in range(new):
                self._itl.labels(**self._labels).observe((now - seen.last_time) / new)
        if new > 0:
            self._generation_tokens.labels(**self._labels).inc(new)
            seen.tokens, seen.last_time = tokens, now
        if output.finished:
            del self._seen[output.request_id]
            self._e2e.labels(**self._labels).observe(now - m.arrival_time)
            for c in output.outputs:
                self._success.labels(**self._labels, finished_reason=c.finish_reason or "none").inc()

    def forget(self, request_id: str) -> None:
        """A request that ended without a finished output (aborted, failed)."""
        self._seen.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
