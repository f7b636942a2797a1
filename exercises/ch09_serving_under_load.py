"""Chapter 09: serving under load — latency percentiles, goodput, Poisson arrivals, a streaming
handler, the price of a token, and a structured-output mask by hand.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch09")` in the
notebook.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Sequence

import torch


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile of values (q in [0, 100]), with linear interpolation between order statistics.

    This is numpy's default (`numpy.percentile(values, q)`, method "linear"): sort the n values,
    take the fractional rank r = (n - 1) * q / 100 and interpolate between the values at ranks
    floor(r) and ceil(r). So q = 0 is the minimum, q = 100 the maximum, q = 50 of an even count the
    mean of the middle two. Returns a float.

    Raises ValueError for an empty sequence or a q outside [0, 100].
    """
    raise NotImplementedError("write me")


def goodput(ttfts_ms: Sequence[float], tpots_ms: Sequence[float], duration_s: float,
            slo_ttft_ms: Optional[float] = None, slo_tpot_ms: Optional[float] = None) -> float:
    """Requests per second that met every latency SLO given (DistServe's goodput, as `vllm bench serve` counts it).

    ttfts_ms[i] and tpots_ms[i] are request i's time to first token and time per output token, in
    ms (a request with a single output token has TPOT 0). A request meets an SLO when its value is
    at most the SLO (equal counts as met); an SLO of None is not checked. Returns the number of
    requests that met all the checked SLOs divided by duration_s, the length of the run in
    seconds. With no SLO at all, that is every request; with no requests, 0.0.

    Raises ValueError when the two lists differ in length or duration_s <= 0.
    """
    raise NotImplementedError("write me")


def poisson_arrival_times(rate: float, num_requests: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """When each of num_requests requests is sent, in seconds from the start, at a mean of rate requests per second.

    The first request goes at 0; each next one follows after a gap drawn from a gamma distribution
    with shape = burstiness and mean 1 / rate (so scale = 1 / (rate * burstiness)), the gaps drawn
    in order from one `random.Random(seed)` with `gammavariate(burstiness, 1 / (rate * burstiness))`
    (the load generator's `minfer.lab.bench.loadgen.arrival_times(num_requests, rate, burstiness, seed)`, note
    the other order, draws the same times).
    burstiness = 1 gives exponential gaps, a Poisson process; below 1 the requests come in
    bursts, above 1 more evenly (the gaps' coefficient of variation is 1 / sqrt(burstiness)).
    rate = float("inf") means all at once: every time is 0.0. Returns a list of floats in
    non-decreasing order ([] for 0 requests).

    Raises ValueError for rate <= 0 (or NaN), a burstiness that is not a positive finite number, or
    num_requests < 0.
    """
    raise NotImplementedError("write me")


def stream_completion_chunks(queue: asyncio.Queue, request_id: str, model: str,
                             created: int) -> AsyncIterator[str]:
    """Stream one completion as OpenAI's Server-Sent Events, from the engine's per-request queue.

    The engine loop puts minfer.outputs.RequestOutput objects on `queue` as the request advances;
    they are cumulative: `.outputs[0].text` is the whole text so far, `.finished` is True on the
    last one, whose `.outputs[0].finish_reason` says why it ended ("stop" or "length"). An
    exception found on the queue (the engine failed) is raised.

    Yields, as each output arrives, one SSE event string `"data: " + json.dumps(chunk) + "\\n\\n"`
    with chunk = {"id": request_id, "object": "text_completion", "created": created,
    "model": model, "choices": [{"index": 0, "text": DELTA, "logprobs": None,
    "finish_reason": REASON}]}, where DELTA is the text not sent yet (the output's text past what earlier chunks sent) and
    REASON is None except in the chunk of the finished output. An unfinished output that added no
    text yields nothing; the finished one always yields its chunk (its delta may be ""). After
    it, yields "data: [DONE]\\n\\n" and stops.

    One catch: a character whose UTF-8 bytes are split over two tokens decodes as "\\ufffd" (the
    replacement character) until its last byte arrives, and then the text so far changes. So in an
    unfinished output, trailing "\\ufffd" characters are held back (not sent yet); the finished
    output's text is sent as it is. (minfer's engine holds such a character back itself,
    minfer/detokenizer.py; a handler should not count on every engine doing so.)

    Write it as an async generator: change `def` to `async def`, await `queue.get()` and `yield`
    each event. (The stub is a plain function only so that calling it raises at once.)
    """
    raise NotImplementedError("write me")


def cost_per_million_tokens(price_per_hour: float, tokens_per_second: float, utilization: float = 1.0) -> float:
    """What a million output tokens cost on a machine rented by the hour.

    price_per_hour: the machine's price per hour, in any currency, paid whether it works or not;
    tokens_per_second: the output tokens per second it sustains while busy; utilization: the
    fraction of the paid hours it is busy, in (0, 1].
    Returns the price of one million output tokens, in the currency of price_per_hour.

    Raises ValueError for price_per_hour < 0, tokens_per_second <= 0 or a utilization outside (0, 1].
    """
    raise NotImplementedError("write me")


def choice_mask(token_texts: Sequence[str], choices: Sequence[str], text_so_far: str, eos_id: int) -> torch.Tensor:
    """Structured output, by hand: which next tokens keep the answer on its way to one of `choices`?

    token_texts[t] is the text token t adds (every id of the vocabulary, in order); text_so_far is
    what the answer says already. Return a bool tensor of len(token_texts): True where the token may
    come next. The end-of-sequence token (eos_id) may come only once the answer is complete. A token
    that adds no text never helps. (The engine's `StructuredOutputsParams(choice=...)` does the same
    with a compiled automaton; the test compares your mask's greedy answers with the engine's.)
    """
    raise NotImplementedError("write me")


def dfa_mask(transitions: dict[int, dict[str, int]], accepting: set[int], state: int,
             token_texts: Sequence[str], eos_id: int) -> torch.Tensor:
    """The same for a regular expression written as a state machine over characters.

    transitions[s][c] is the state after reading character c in state s (a missing entry: c is not
    allowed there); `accepting` holds the states where the text may end. From `state`, which tokens
    may come next? A token is read character by character. Return a bool tensor of len(token_texts).
    """
    raise NotImplementedError("write me")


def dfa_advance(transitions: dict[int, dict[str, int]], state: int, text: str) -> int:
    """The state after reading `text` from `state` (a KeyError if the text leaves the machine)."""
    raise NotImplementedError("write me")
