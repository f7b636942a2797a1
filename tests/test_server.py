"""The OpenAI-compatible server (`python -m minfer serve`), through the official `openai` client.

Servers run as real subprocesses on free local ports: the real model for the answers (compared
with the offline `LLM`), a tiny random model where only the server's behaviour matters (auth,
the waiting-queue limit, SIGTERM).
"""
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from minfer import SamplingParams
from minfer.lab.bench.launch import free_port, stop_server, wait_until_ready
from minfer.lab.bench.soak import server_metrics

MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow  # servers start in subprocesses: about 90 s for the file


class Server:
    """`python -m minfer serve MODEL --port P ARGS...` in a subprocess, ready once /health answers."""

    def __init__(self, model: str, *args: str, env: dict = None, tries: int = 3) -> None:
        for attempt in range(tries):
            # a free port can be taken by another test process before the server binds it: then take another
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.proc = subprocess.Popen([sys.executable, "-m", "minfer", "serve", model, "--port", str(self.port), *args],
                                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                wait_until_ready(self.url, self.proc, timeout_s=120)
                return
            except RuntimeError as exc:
                self.stop()
                output = self.proc.stdout.read()
                if "address already in use" not in output or attempt == tries - 1:
                    raise RuntimeError(f"{exc}:\n{output}") from None

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs)

    def metric(self, name: str) -> float:
        return server_metrics(self.url)[name]

    def stop(self) -> int:
        return stop_server(self.proc)


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture(scope="module")
def server():
    s = Server(MODEL, "--dtype", "float32", "--max-num-seqs", "8")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random model with a long context: a request of 4,000 tokens runs for seconds."""
    from minfer.lab.testing import MODEL_SHAPES, random_checkpoint

    shape = dataclasses.replace(MODEL_SHAPES["tiny"], max_position_embeddings=4096)
    return random_checkpoint(str(tmp_path_factory.mktemp("tiny_served")), shape)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are"]


def offline(llm, prompts, **params) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(**params), use_tqdm=False)]


# ---------------------------------------------------------------- answers
def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_equals_offline_greedy(server, llm):
    client = server.client()
    expected = offline(llm, PROMPTS[:2], temperature=0, max_tokens=12)
    for prompt, want in zip(PROMPTS, expected):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12
        assert r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt, add_special_tokens=False))
        assert r.id.startswith("cmpl-") and r.created > 0 and r.object == "text_completion"


def test_streamed_completion_equals_offline(server, llm):
    (want,) = offline(llm, [PROMPTS[0]], temperature=0, max_tokens=12)
    chunks = list(server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 2, "a stream should arrive in pieces"
    assert "".join(texts) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_equals_offline_chat(server, llm):
    messages = [{"role": "user", "content": "Name a fruit that is yellow."}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.usage.completion_tokens <= 16
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_concurrent_requests_equal_their_solo_answers(server, llm):
    prompts = [f"{p} ({i})" for i, p in enumerate(PROMPTS * 3)]
    expected = offline(llm, prompts, temperature=0, max_tokens=10)
    client = server.client()

    def ask(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == expected


def test_list_of_prompts_n_seed_stop_and_logprobs(server, llm):
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0, logprobs=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == offline(llm, PROMPTS[:2], temperature=0, max_tokens=8)
    lp = r.choices[0].logprobs
    want = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)[0]
    assert lp.token_logprobs == pytest.approx([next(iter(d.values())).logprob for d in want.outputs[0].logprobs], abs=1e-4)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    sampled = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, seed=3, n=3)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0.8, seed=3, n=3)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # the seed makes them repeatable
    (want_stop,) = offline(llm, [PROMPTS[1]], temperature=0, max_tokens=30, stop=["\n"])
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=["\n"],
                                        stream=True)
    assert "".join(c.choices[0].text for c in stopped) == want_stop and "\n" not in want_stop


def test_disconnect_mid_stream_aborts_the_request(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        events = (line for line in response.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(events)
        assert server.metric("num_requests_running") == 1
    # the client is gone: within a step or two the request is aborted and its blocks are free
    assert wait_until(lambda: server.metric("num_requests_running") == 0)
    assert wait_until(lambda: server.metric("kv_cache_usage_perc") == 0)
    assert server.metric("generation_tokens_total") < 1000  # it did not run to its 400 tokens


def test_bad_requests_get_4xx_and_the_server_stays_correct(server, llm):
    url = server.url + "/v1/completions"
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    bad_bodies = [
        {**ok, "temperature": -1}, {**ok, "top_p": 0}, {**ok, "max_tokens": 0}, {**ok, "n": 0},
        {**ok, "top_k": -5}, {**ok, "logprobs": 99}, {**ok, "prompt": ""}, {**ok, "prompt": []},
        {**ok, "prompt": "word " * 9000},  # longer than the context window
        {**ok, "max_tokenz": 3},  # a misspelled field
        {**ok, "temperature": "hot"}, {"model": MODEL}, {**ok, "stop": [""]}, {**ok, "presence_penalty": 1.0},
        {**ok, "prompt": [[1, 2], [10 ** 9]]},
    ]
    for body in bad_bodies:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["code"] == 400 and error["type"] == "BadRequestError"
    named = [  # (body, the field or problem the message must name)
        ({**ok, "temperature": float("nan")}, "temperature"), ({**ok, "seed": 2 ** 64}, "seed"),
        ({**ok, "prompt": [1] * 8150, "max_tokens": 100}, "more than the context window of 8192 tokens; ask for at most 42"),
        ({**ok, "logprobs": 21}, "logprobs"),
    ]
    for body, words in named:  # (json.dumps writes NaN as JSON's parsers read it, which httpx's json= refuses)
        r = httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    chat_url, question = server.url + "/v1/chat/completions", {"role": "user", "content": "Hi"}
    r = httpx.post(chat_url, json={"model": MODEL, "messages": [question], "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"], r.text
    # JSON may carry a lone surrogate, which is not text: a 400 in OpenAI's error shape, not a 500
    for endpoint, raw in ((url, b'{"prompt": "\\ud800", "max_tokens": 2}'),
                          (chat_url, b'{"messages": [{"role": "user", "content": "\\ud800"}]}')):
        r = httpx.post(endpoint, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "BadRequestError"
    assert httpx.post(url, json={**ok, "model": "gpt-4"}).status_code == 404
    chat = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert chat.status_code == 400
    chat = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert chat.status_code == 400
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().completions.create(model=MODEL, prompt="Hi", temperature=-2)
    assert server.metric("num_requests_running") == 0 and server.metric("num_requests_waiting") == 0
    (want,) = offline(llm, [PROMPTS[2]], temperature=0, max_tokens=6)
    assert server.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6,
                                              temperature=0).choices[0].text == want


def test_a_tiny_temperature_is_raised_to_the_floor_and_takes_no_one_down(server, llm):
    # 1e-300 once divided the logits into infinities: the NaN sample failed every request of the step
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        greedy = pool.submit(lambda: client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0))
        tiny = pool.submit(lambda: client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=1e-300))
        (want,) = offline(llm, [PROMPTS[0]], temperature=0, max_tokens=40)
        assert greedy.result().choices[0].text == want
        assert tiny.result().choices[0].text == want[:len(tiny.result().choices[0].text)]  # 0.01: greedy in effect


def test_streamed_logprob_offsets_continue_across_chunks(server):
    client = server.client()
    args = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=1)
    whole = client.completions.create(**args).choices[0].logprobs.text_offset
    streamed = [o for chunk in client.completions.create(**args, stream=True)
                for c in chunk.choices if c.logprobs for o in c.logprobs.text_offset]
    assert streamed == whole and whole[0] == 0 and len(set(whole)) > 1 and whole == sorted(whole)


def test_chat_content_as_text_parts(server):
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    answers = [server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                      max_tokens=8, temperature=0).choices[0].message.content
               for content in (parts, "Name a colour.\nOne word.")]
    assert answers[0] == answers[1]


def test_metrics_count_tokens_and_latencies(server):
    before = server.metric("generation_tokens_total")
    server.client().completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert server.metric("generation_tokens_total") == before + 5
    text = httpx.get(server.url + "/metrics").text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "request_success_total",
                 "num_preemptions_total"):
        assert f"minfer:{name}" in text
    assert "spec_decode" not in text  # speculative decoding is off


def test_metrics_count_draft_tokens(tiny_model):
    s = Server(tiny_model, "--served-model-name", "tiny", "--speculative-model", "[ngram]", "--num-speculative-tokens", "3")
    try:
        assert s.metric("spec_decode_num_draft_tokens_total") == 0
        s.client().completions.create(model="tiny", prompt="a b a b a b a b", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        drafts, accepted = s.metric("spec_decode_num_draft_tokens_total"), s.metric("spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 <= accepted <= drafts and s.metric("spec_decode_num_drafts_total") > 0
        per_position = re.findall(r'^minfer:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d)"\} (\S+)$',
                                  httpx.get(s.url + "/metrics").text, re.M)
        assert [p for p, _ in per_position] == ["0", "1", "2"][: len(per_position)] and per_position
        assert sum(float(v) for _, v in per_position) == accepted
    finally:
        assert s.stop() == 0


def test_async_scheduling_answers_as_the_offline_engine_and_aborts_cleanly(tiny_model):
    """--async-scheduling: concurrent plain and streamed completions equal the synchronous offline engine's; a client
    that leaves mid-stream (its next token in flight) is aborted and its blocks come back."""
    from minfer import LLM

    s = Server(tiny_model, "--served-model-name", "tiny", "--async-scheduling", "--max-num-seqs", "4")
    try:
        prompts = [f"a b c d {'e ' * i}" for i in range(8)]
        expected = offline(LLM(tiny_model), prompts, temperature=0, max_tokens=12, ignore_eos=True)
        client = s.client()

        def ask(i: int) -> str:
            args = dict(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
            if i % 2:
                return "".join(c.choices[0].text for c in client.completions.create(stream=True, **args))
            return client.completions.create(**args).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, range(len(prompts)))) == expected
        body = {"model": "tiny", "prompt": prompts[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as response:
            events = (line for line in response.iter_lines() if line.startswith("data:"))
            for _ in range(3):
                next(events)
        assert wait_until(lambda: s.metric("num_requests_running") == 0)
        assert wait_until(lambda: s.metric("kv_cache_usage_perc") == 0)
    finally:
        assert s.stop() == 0


# ---------------------------------------------------------------- limits and lifecycle (a tiny model)
def test_api_key(tiny_model):
    s = Server(tiny_model, "--served-model-name", "tiny", env={"MINFER_API_KEY": "sesame"})
    try:
        assert httpx.get(s.url + "/health").status_code == 200  # health stays open for load balancers
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="tiny", prompt="a b", max_tokens=2)
        r = s.client("sesame").completions.create(model="tiny", prompt="a b", max_tokens=2)
        assert r.usage.completion_tokens == 2
    finally:
        assert s.stop() == 0


def test_waiting_queue_limit_and_body_limit(tiny_model):
    s = Server(tiny_model, "--served-model-name", "tiny", "--max-num-seqs", "1", "--max-waiting-requests", "1",
               "--max-body-bytes", "2000")
    long = {"model": "tiny", "prompt": "a b c", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2:
            with c1.stream("POST", s.url + "/v1/completions", json=long) as first:
                first_lines = first.iter_lines()  # kept: a dropped iterator closes the connection
                next(first_lines)  # the first request is running
                with c2.stream("POST", s.url + "/v1/completions", json=long) as second:
                    assert second.status_code == 200
                    assert wait_until(lambda: s.metric("num_requests_waiting") == 1)
                    third = httpx.post(s.url + "/v1/completions", json=long, timeout=30)
                    assert third.status_code == 503, third.text
                    assert third.headers["retry-after"] and third.json()["error"]["code"] == 503
        many = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2, "n": 2})
        assert many.status_code == 400 and "would add 2 sequences (prompts x n)" in many.json()["error"]["message"]
        big = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x " * 2000})
        assert big.status_code == 413 and "limit" in big.json()["error"]["message"]
        assert wait_until(lambda: s.metric("num_requests_running") == 0 and s.metric("num_requests_waiting") == 0)
        assert s.client().completions.create(model="tiny", prompt="a", max_tokens=3).usage.completion_tokens == 3
    finally:
        assert s.stop() == 0


def test_sigterm_finishes_running_requests_then_exits_0(tiny_model):
    s = Server(tiny_model, "--served-model-name", "tiny", "--max-num-seqs", "1")
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
        s.proc.send_signal(signal.SIGTERM)
        events = [line[len("data: "):] for line in lines if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # it ran to its end
    assert s.proc.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")


def test_streamed_n_and_echo_match_the_whole_answers(server):
    client = server.client()
    args = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0.9, seed=11, n=2)
    whole = client.completions.create(**args)
    pieces = {0: "", 1: ""}
    finals = []
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            pieces[c.index] += c.text
            if c.finish_reason is not None:
                finals.append(c.index)
    assert sorted(finals) == [0, 1], "each choice ends exactly once"
    assert pieces == {c.index: c.text for c in whole.choices}
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text


def test_response_format_structured_outputs_and_the_clients_parse_helper(server):
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=16)
        age: int = pydantic.Field(ge=0, le=120)

    client = server.client()
    messages = [{"role": "user", "content": "Ann is 31. Give her as JSON."}]
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(model=MODEL, messages=messages, response_format=Person, max_tokens=80, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Person)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, temperature=0,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    chosen = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, n=3,
                                       temperature=1.0, extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert {c.text for c in chosen.choices} <= {" yes", " no"}
    bad = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}})
    assert bad.status_code == 400 and "cannot be compiled: Unsupported type" in bad.json()["error"]["message"]
