"""Chapter 09: percentiles against numpy and by hand, goodput by hand, Poisson/gamma arrivals against
their definition and their statistics, the streaming handler on hand-built engine outputs, and the
cost formula."""
import asyncio
import json
import math
import random

import numpy as np
import pytest

from minfer.outputs import CompletionOutput, RequestOutput


# ----------------------------------------------------------------- percentiles and goodput

def test_percentile_by_hand(impl):
    assert impl.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert impl.percentile([4, 1, 3, 2], 0) == 1.0 and impl.percentile([4, 1, 3, 2], 100) == 4.0  # any order
    assert impl.percentile(list(range(11)), 90) == pytest.approx(9.0)
    assert impl.percentile(list(range(1, 101)), 99) == pytest.approx(99.01)  # rank 98.01: 99 + 0.01 * (100 - 99)
    assert impl.percentile([7.5], 37) == 7.5
    assert isinstance(impl.percentile([1, 2], 50), float)


def test_percentile_equals_numpy(impl):
    rng = np.random.default_rng(0)
    for n in [1, 2, 3, 10, 101, 1000]:
        values = rng.lognormal(3, 1, n).tolist()
        for q in [0, 1, 25, 50, 62.5, 90, 99, 99.9, 100]:
            assert impl.percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12), (n, q)


def test_percentile_refuses_bad_input(impl):
    with pytest.raises(ValueError):
        impl.percentile([], 50)
    for q in [-1, 100.5, float("nan")]:
        with pytest.raises(ValueError):
            impl.percentile([1, 2, 3], q)


def test_goodput_by_hand(impl):
    ttfts = [100, 200, 300, 400]
    tpots = [10, 50, 20, 0]  # the last request made one token: TPOT 0
    assert impl.goodput(ttfts, tpots, 2.0) == pytest.approx(2.0)  # no SLO: every request counts
    assert impl.goodput(ttfts, tpots, 2.0, slo_ttft_ms=300) == pytest.approx(1.5)  # 300 meets an SLO of 300
    assert impl.goodput(ttfts, tpots, 2.0, slo_tpot_ms=20) == pytest.approx(1.5)
    assert impl.goodput(ttfts, tpots, 2.0, slo_ttft_ms=300, slo_tpot_ms=20) == pytest.approx(1.0)  # both: 0 and 2
    assert impl.goodput(ttfts, tpots, 0.5, slo_ttft_ms=50) == 0.0
    assert impl.goodput([], [], 1.0, slo_ttft_ms=100) == 0.0


def test_goodput_never_exceeds_throughput_and_grows_with_the_slo(impl):
    rng = np.random.default_rng(1)
    ttfts, tpots = rng.exponential(500, 200).tolist(), rng.exponential(40, 200).tolist()
    previous = 0.0
    for slo in [10, 100, 300, 1000, 5000, 1e9]:
        g = impl.goodput(ttfts, tpots, 10.0, slo_ttft_ms=slo, slo_tpot_ms=slo / 10)
        assert previous <= g <= 200 / 10.0
        previous = g
    assert previous == pytest.approx(20.0)


def test_goodput_equals_the_load_generators(impl):
    from minfer.lab.bench.latency import request_goodput, time_per_output_token
    from minfer.lab.bench.loadgen import RequestResult

    rng = np.random.default_rng(2)
    results = []
    for _ in range(100):
        ttft, n = float(rng.exponential(0.8)), int(rng.integers(1, 40))
        results.append(RequestResult(success=True, ttft=ttft, latency=ttft + (n - 1) * float(rng.exponential(0.05)),
                                     output_len=n))
    ttfts = [r.ttft * 1000 for r in results]
    tpots = [(time_per_output_token(r.latency, r.ttft, r.output_len) or 0.0) * 1000 for r in results]
    for slos in [{"ttft": 500.0}, {"tpot": 40.0}, {"ttft": 1000.0, "tpot": 60.0}]:
        assert impl.goodput(ttfts, tpots, 12.5, slos.get("ttft"), slos.get("tpot")) == \
            pytest.approx(request_goodput(results, slos, 12.5))


def test_goodput_refuses_bad_input(impl):
    with pytest.raises(ValueError):
        impl.goodput([1, 2], [1], 1.0)
    for duration in [0, -1.0]:
        with pytest.raises(ValueError):
            impl.goodput([1], [1], duration)


# ----------------------------------------------------------------- arrivals

def test_arrivals_are_the_cumulative_gamma_gaps(impl):
    for rate, burstiness, seed in [(2.0, 1.0, 0), (0.5, 0.3, 7), (10.0, 4.0, 1)]:
        rng = random.Random(seed)
        expected = [0.0]
        for _ in range(49):
            expected.append(expected[-1] + rng.gammavariate(burstiness, 1 / (rate * burstiness)))
        times = impl.poisson_arrival_times(rate, 50, seed, burstiness)
        assert isinstance(times, list) and len(times) == 50
        assert times == pytest.approx(expected, rel=1e-12)
        assert all(isinstance(t, float) for t in times)
    assert impl.poisson_arrival_times(3.0, 20, 5) == impl.poisson_arrival_times(3.0, 20, 5)  # same seed, same times
    assert impl.poisson_arrival_times(3.0, 20, 5) != impl.poisson_arrival_times(3.0, 20, 6)


def test_arrivals_are_the_load_generators(impl):
    from minfer.lab.bench.loadgen import arrival_times

    for rate, burstiness, seed in [(1.5, 1.0, 0), (8.0, 0.5, 3), (0.2, 2.0, 11)]:
        assert impl.poisson_arrival_times(rate, 30, seed, burstiness) == \
            pytest.approx(arrival_times(30, rate, burstiness, seed), rel=1e-12)


def test_arrivals_keep_the_rate(impl):
    # 20 000 gaps with a fixed seed: the mean gap is 1/rate to within 2 % (its standard error is 0.7 %)
    for rate in [0.5, 4.0, 50.0]:
        times = impl.poisson_arrival_times(rate, 20_000, seed=0)
        assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
        assert times[-1] / (len(times) - 1) == pytest.approx(1 / rate, rel=0.02)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_spread_of_the_gaps(impl, burstiness):
    times = impl.poisson_arrival_times(2.0, 20_000, seed=3, burstiness=burstiness)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)  # the mean rate does not depend on burstiness
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_everything_at_once(impl):
    assert impl.poisson_arrival_times(float("inf"), 5, seed=0) == [0.0] * 5
    assert impl.poisson_arrival_times(1.0, 0, seed=0) == []


@pytest.mark.parametrize("args", [(0.0, 5, 0), (-1.0, 5, 0), (float("nan"), 5, 0), (1.0, -1, 0), (1.0, 5, 0, 0.0),
                                  (1.0, 5, 0, -2.0), (1.0, 5, 0, float("inf"))],
                         ids=["rate0", "rate<0", "rate-nan", "count<0", "burst0", "burst<0", "burst-inf"])
def test_arrivals_refuse_bad_input(impl, args):
    with pytest.raises(ValueError):
        impl.poisson_arrival_times(*args)


# ----------------------------------------------------------------- the streaming handler

def output(text: str, finished: bool = False, reason: str = "length") -> RequestOutput:
    """A cumulative engine output, as minfer's engine emits them (token ids do not matter here)."""
    return RequestOutput("cmpl-7", "a prompt", [1, 2, 3],
                         [CompletionOutput(0, text, [], finish_reason=reason if finished else None)], finished)


def stream(impl, outputs, request_id="cmpl-7", model="smollm2", created=1700000000) -> list[str]:
    async def main():
        queue = asyncio.Queue()
        for out in outputs:
            queue.put_nowait(out)
        return [event async for event in impl.stream_completion_chunks(queue, request_id, model, created)]

    return asyncio.run(main())


def parse(events: list[str]) -> list[dict]:
    """The JSON chunks of an SSE stream, after checking its framing: each event is one `data:` line."""
    assert events[-1] == "data: [DONE]\n\n"
    chunks = []
    for event in events[:-1]:
        assert isinstance(event, str) and event.startswith("data: ") and event.endswith("\n\n")
        assert event.count("\n") == 2, f"an event must be one line (newlines inside JSON are escaped): {event!r}"
        chunks.append(json.loads(event[len("data: "):]))
    return chunks


def test_stream_sends_deltas_then_done(impl):
    events = stream(impl, [output("Hel"), output("Hello"), output("Hello, wor"), output("Hello, world", True, "stop")])
    chunks = parse(events)
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo", ", wor", "ld"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    for c in chunks:
        assert (c["id"], c["object"], c["model"], c["created"]) == ("cmpl-7", "text_completion", "smollm2", 1700000000)
        assert c["choices"][0]["index"] == 0 and c["choices"][0]["logprobs"] is None


def test_stream_skips_empty_deltas_but_always_sends_the_last_chunk(impl):
    # the text can stand still for a token (half a UTF-8 character, a stop string held back)
    chunks = parse(stream(impl, [output(""), output("Hi"), output("Hi"), output("Hi!"), output("Hi!", True)]))
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == \
        [("Hi", None), ("!", None), ("", "length")]


def test_stream_holds_back_half_a_character(impl):
    # "é" is two bytes in UTF-8; after the first of them the text ends in U+FFFD, after the second it is "é"
    outputs = [output("caf"), output("caf\ufffd"), output("café"), output("café \ufffd"), output("café \ufffd", True)]
    chunks = parse(stream(impl, outputs))
    assert [c["choices"][0]["text"] for c in chunks] == ["caf", "é", " ", "\ufffd"]  # the finished text as it ended
    assert "".join(c["choices"][0]["text"] for c in chunks) == "café \ufffd"


def test_stream_keeps_each_event_on_one_line(impl):
    text = "line one\n\nline two\ndata: [DONE]\n\n\"quoted\" é"
    chunks = parse(stream(impl, [output(text[:12]), output(text[:30]), output(text, True, "stop")]))
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_stream_ends_at_the_finished_output(impl):
    # anything after the finished output belongs to no one: the handler must not wait for it or send it
    events = stream(impl, [output("a"), output("ab", True), output("abc")])
    assert [c["choices"][0]["text"] for c in parse(events)] == ["a", "b"]


def test_stream_yields_each_chunk_as_its_output_arrives(impl):
    async def main():
        queue = asyncio.Queue()
        received = []

        async def engine():
            for text in ["one", "one two"]:
                await queue.put(output(text))
                await asyncio.sleep(0.01)
                received.append(len(chunks))  # how many chunks the client had when the next token came
            await queue.put(output("one two three", True))

        chunks = []
        producer = asyncio.create_task(engine())
        async for event in impl.stream_completion_chunks(queue, "cmpl-7", "m", 0):
            chunks.append(event)
        await producer
        return received, chunks

    received, chunks = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert received == [1, 2], "each chunk must be yielded when its output arrives, not after the request ends"
    assert len(chunks) == 4


def test_stream_raises_the_engines_error(impl):
    with pytest.raises(RuntimeError, match="engine died"):
        stream(impl, [output("a"), RuntimeError("engine died")])


# ----------------------------------------------------------------- cost

def test_cost_per_million_tokens_by_hand(impl):
    assert impl.cost_per_million_tokens(3.6, 1000) == pytest.approx(1.0)  # 3.6 M tokens an hour for 3.6
    assert impl.cost_per_million_tokens(2.0, 100, utilization=0.5) == pytest.approx(2.0 / (100 * 0.5 * 3600) * 1e6)
    assert impl.cost_per_million_tokens(0.0, 50) == 0.0


def test_cost_scales_inversely_with_utilization_and_throughput(impl):
    busy = impl.cost_per_million_tokens(4.0, 200, utilization=0.8)
    idle = impl.cost_per_million_tokens(4.0, 200, utilization=0.05)
    assert idle / busy == pytest.approx(16.0)  # the same machine, 16x the price per token at 5 % busy
    assert impl.cost_per_million_tokens(4.0, 400) == pytest.approx(impl.cost_per_million_tokens(4.0, 200) / 2)


@pytest.mark.parametrize("args", [(-1.0, 100), (1.0, 0), (1.0, -5), (1.0, 100, 0.0), (1.0, 100, 1.5), (1.0, 100, -0.1)],
                         ids=["price<0", "tps0", "tps<0", "util0", "util>1", "util<0"])
def test_cost_refuses_bad_input(impl, args):
    with pytest.raises(ValueError):
        impl.cost_per_million_tokens(*args)


# ---------------------------------------------------------------- structured output by hand
TOY = ["y", "ye", "yes", "n", "no", "", "x", " yes", "s", "<end>"]  # token id = index; 9 ends the sequence


def allowed(mask) -> list[str]:
    return [TOY[i] for i in range(len(TOY)) if bool(mask[i])]


def test_choice_mask_by_hand(impl):
    assert allowed(impl.choice_mask(TOY, ["yes", "no"], "", 9)) == ["y", "ye", "yes", "n", "no"]
    assert allowed(impl.choice_mask(TOY, ["yes", "no"], "ye", 9)) == ["s"]
    assert allowed(impl.choice_mask(TOY, ["yes", "no"], "yes", 9)) == ["<end>"]
    assert allowed(impl.choice_mask(TOY, ["yes", "yesno"], "yes", 9)) == ["n", "no", "<end>"]  # whole, or go on


DIGITS = {s: {str(d): s + 1 for d in range(10)} for s in (0, 1, 3)}
DASHED = {**DIGITS, 2: {"-": 3}}  # [0-9]{2}-[0-9]: states 0 -digit-> 1 -digit-> 2 -"-"-> 3 -digit-> 4
DASHED_TOKENS = ["1", "12", "123", "2-", "-", "-5", "5", "", "a", "<end>"]


def test_dfa_mask_and_advance_by_hand(impl):
    def ok(state):
        mask = impl.dfa_mask(DASHED, {4}, state, DASHED_TOKENS, 9)
        return [DASHED_TOKENS[i] for i in range(len(DASHED_TOKENS)) if bool(mask[i])]

    assert ok(0) == ["1", "12", "5"]
    assert ok(1) == ["1", "2-", "5"]
    assert ok(2) == ["-", "-5"]
    assert ok(4) == ["<end>"]
    assert impl.dfa_advance(DASHED, 0, "12") == 2 and impl.dfa_advance(DASHED, 1, "2-5") == 4
    with pytest.raises(KeyError):
        impl.dfa_advance(DASHED, 0, "1-")


def test_your_masks_give_the_engines_structured_answers(impl, tiny_dir):
    import torch

    from minfer import LLM, SamplingParams
    from minfer.sampling_params import StructuredOutputsParams

    llm = LLM(tiny_dir, dtype="float32", device="cpu")
    tok = llm.tokenizer
    texts = [tok.decode([t]) for t in range(llm.model.config.vocab_size)]
    (eos,) = llm.engine.eos_token_ids
    prompt = tok.encode("The answer is")

    def greedy(mask_for, advance=lambda state, text: state) -> str:  # each step, the best token your mask allows
        ids, out, state = list(prompt), [], 0
        for _ in range(12):
            logits = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
            token = int(torch.where(mask_for(out, state), logits, -torch.inf).argmax())
            if token == eos:
                break
            state = advance(state, texts[token])
            out.append(token)
            ids.append(token)
        return tok.decode(out)

    def engine(shape) -> str:
        params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=shape)
        return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].text

    choices = [" alpha", " beta", " gamma", " gamma delta"]
    ours = greedy(lambda out, _: impl.choice_mask(texts, choices, tok.decode(out), eos))
    assert ours in choices and ours == engine(StructuredOutputsParams(choice=choices))

    ours = greedy(lambda out, state: impl.dfa_mask(DASHED, {4}, state, texts, eos),
                  lambda state, text: impl.dfa_advance(DASHED, state, text))
    assert len(ours) == 4 and ours == engine(StructuredOutputsParams(regex="[0-9]{2}-[0-9]"))
