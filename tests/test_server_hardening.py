"""One client cannot hurt the others: strict types, limits on each request's work, admission under
bursts, stalled and slow clients, errors that say what went wrong, and a shutdown that tells streams.

Servers run as real subprocesses (a tiny random model: only the server's behaviour matters here);
the pieces that need no server (the stream's hold-back, the engine's snapshot) run in-process.
"""
import asyncio
import concurrent.futures
import json
import random
import signal
import socket
import threading
import time

import httpx
import pytest

from minfer import LLM, SamplingParams
from minfer.serving import protocol as api
from minfer.serving.async_engine import AsyncEngine, RequestFailed
from minfer.serving.metrics import ServerMetrics
from test_server import Server, wait_until

URL = "/v1/completions"


# ---------------------------------------------------------------- the stream's hold-back (no server)
def naive_hold_back(text: str, stops: list[str]) -> int:
    """The definition: the longest proper prefix of a stop string that ends the text."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_hold_back_is_the_longest_stop_prefix_ending_the_text():
    hold = api.HoldBack(["\n\n"])
    assert hold.held("Hello\n") == 1  # may become the stop string
    assert api.HoldBack("ENDING").held("ab END") == 3 and api.HoldBack(None).held("Hello wor") == 0
    rng = random.Random(0)
    for _ in range(2000):  # the automaton, fed in random chunks, against the definition
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        hold, at = api.HoldBack(stops), 0
        while at < len(text):
            at = min(len(text), at + rng.randint(1, 4))
            assert hold.held(text[:at]) == naive_hold_back(text[:at], stops), (stops, text[:at])


def test_hold_back_costs_the_new_text_not_the_stop_strings_length():
    def stream_time(stop: str) -> float:
        hold, text = api.HoldBack(stop), ""
        start = time.perf_counter()
        for _ in range(300):  # a stream of 300 chunks that keeps nearly matching the stop string
            text += "xxx"
            hold.held(text)
        return time.perf_counter() - start

    short, long = min(stream_time("x" * 20 + "y") for _ in range(3)), min(stream_time("x" * 200_000 + "y") for _ in range(3))
    assert long < 10 * short, (long, short)  # searching every prefix afresh: about 10,000x


def test_request_limits_name_the_flag():
    limits = api.RequestLimits(max_n=4, max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=3)
    body = lambda **kw: api.CompletionRequest(prompt="x", **kw)  # noqa: E731
    limits.check(body(n=4, stop=["abcde", "b"], stop_token_ids=[1, 2, 3]))
    for kw, words in [(dict(n=5), "n is 5; this server allows at most 4 (its --max-n)"),
                      (dict(stop=["a", "b", "c"]), "--max-stop-strings"), (dict(stop="abcdef"), "--max-stop-string-chars"),
                      (dict(stop_token_ids=[1, 2, 3, 4]), "--max-stop-token-ids")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            limits.check(body(**kw))


# ---------------------------------------------------------------- the engine thread and the event loop (no server)
class ThreadCheckedList(list):
    """A scheduler queue that records reads from any thread but the engine's."""

    foreign_reads: list = []

    def _check(self):
        if not threading.current_thread().name.startswith("minfer-engine"):
            ThreadCheckedList.foreign_reads.append(threading.current_thread().name)

    def __len__(self):
        self._check()
        return super().__len__()

    def __iter__(self):
        self._check()
        return super().__iter__()


def test_the_event_loop_reads_only_snapshots_and_failures_are_logged(tiny_dir, caplog):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    ThreadCheckedList.foreign_reads.clear()

    async def main():
        engine = AsyncEngine(llm, max_waiting_requests=8)
        scheduler = llm.engine.scheduler  # watched from here on: the server is running
        scheduler.running = ThreadCheckedList(scheduler.running)
        metrics = ServerMetrics(engine, "tiny")
        engine.listener = metrics
        await engine.start()
        group = await engine.add_requests(["a b c"], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
        seen = []
        async for _, output in engine.stream(group):
            seen.append((engine.num_running, engine.num_waiting))
            metrics.render()
        assert output.finished and len(output.outputs[0].token_ids) == 6
        assert seen[0][0] == 1 and engine.snapshot.num_running == 0 and engine.snapshot.kv_cache_usage == 0
        # a step that raises: every request in flight ends with the reason, and the log names them
        original = llm.step
        llm.step = lambda: (_ for _ in ()).throw(RuntimeError("a broken kernel"))
        group = await engine.add_requests(["a b"], SamplingParams(max_tokens=4))
        with pytest.raises(RequestFailed, match="a broken kernel"):
            async for _ in engine.stream(group):
                pass
        llm.step = original
        await engine.shutdown()
        return group.request_ids[0]

    with caplog.at_level("ERROR", logger="minfer.serving"):
        failed_id = asyncio.run(main())
    assert ThreadCheckedList.foreign_reads == []
    assert any("engine step failed" in r.getMessage() and failed_id in r.getMessage() for r in caplog.records)
    assert not llm.has_unfinished_requests() and llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_a_request_whose_prompt_scoring_fails_fails_alone(tiny_dir, monkeypatch):
    import minfer.engine.engine as engine_module

    llm = LLM(tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=64)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    solo = llm.generate(["one two three", "four five"], greedy, use_tqdm=False)
    real = engine_module.logprobs_of

    def broken_for_a_prompt_logprobs_of_3(logits, tokens, top_n, tokenizer):
        if top_n == 3:
            raise RuntimeError("scoring broke")
        return real(logits, tokens, top_n, tokenizer)

    monkeypatch.setattr(engine_module, "logprobs_of", broken_for_a_prompt_logprobs_of_3)
    scored = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate(["one two three", "six seven", "four five"], [greedy, scored, greedy], use_tqdm=False)
    assert [o.outputs[0].text for o in (outs[0], outs[2])] == [o.outputs[0].text for o in solo]
    assert outs[1].outputs[0].finish_reason == "error" and "scoring broke" in outs[1].outputs[0].stop_reason
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


# ---------------------------------------------------------------- through a server (slow: subprocesses)
@pytest.fixture(scope="module")
def tiny_model(tiny_4k_dir) -> str:
    return tiny_4k_dir


@pytest.fixture(scope="module")
def server(tiny_model):
    s = Server(tiny_model, "--served-model-name", "tiny", "--max-num-seqs", "4", "--max-n", "4",
               "--max-stop-strings", "3", "--max-stop-string-chars", "64", "--max-request-tokens", "3000")
    yield s
    assert s.stop() == 0


@pytest.mark.slow
def test_types_are_strict_and_errors_say_what_was_wrong(server):
    ok = {"model": "tiny", "prompt": "a b", "max_tokens": 2}
    for body, field in [({**ok, "prompt": [True, False]}, "prompt"), ({**ok, "max_tokens": "2"}, "max_tokens"),
                        ({**ok, "max_tokens": True}, "max_tokens"), ({**ok, "stream": "yes"}, "stream"),
                        ({**ok, "temperature": True}, "temperature"), ({**ok, "n": 1.0}, "n"),
                        ({**ok, "stop_token_ids": [True]}, "stop_token_ids"),
                        ({**ok, "structured_outputs": {"choice": [""]}}, "choice must be a list of non-empty strings")]:
        r = httpx.post(server.url + URL, json=body, timeout=30)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert chat.status_code == 400 and "role" in chat.json()["error"]["message"]
    form = httpx.post(server.url + URL, content=b"prompt=a", headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and "Content-Type: application/json" in form.json()["error"]["message"], form.text
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["root"] == "tiny"  # a name, not a file path


@pytest.mark.slow
def test_limits_on_each_requests_work(server):
    ok = {"model": "tiny", "prompt": "a b", "max_tokens": 2}
    for body, words in [({**ok, "n": 5}, "--max-n"), ({**ok, "stop": ["a", "b", "c", "d"]}, "--max-stop-strings"),
                        ({**ok, "stop": "z" * 65}, "--max-stop-string-chars"),
                        ({**ok, "n": 4, "max_tokens": 1000}, "lower max_tokens or n")]:
        r = httpx.post(server.url + URL, json=body, timeout=30)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 4}  # no max_tokens: up to 4096 each
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and "more than the limit of 3000" in r.json()["error"]["message"], r.text
    assert httpx.post(server.url + URL, json={**ok, "n": 4, "stop": "z" * 64}, timeout=30).status_code == 200


@pytest.mark.slow
def test_degenerate_settings_beside_running_requests_change_nobodys_text(server):
    plain = {"model": "tiny", "prompt": "a b c d", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    solo = httpx.post(server.url + URL, json=plain, timeout=60).json()["choices"][0]["text"]
    degenerate = [{"top_p": 1e-300}, {"min_p": 1.0, "temperature": 5.0}, {"top_k": 1, "top_p": 5e-324},
                  {"temperature": 1e-300, "seed": 2 ** 63 - 1}, {"logprobs": 20, "top_p": 1e-30, "stop": ["a", "b b"]}]
    bodies = [plain, *({"model": "tiny", "prompt": "x y", "max_tokens": 16, **d} for d in degenerate), plain]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda b: httpx.post(server.url + URL, json=b, timeout=60), bodies))
    assert [r.status_code for r in replies] == [200] * len(bodies), [r.text for r in replies]
    assert replies[0].json()["choices"][0]["text"] == replies[-1].json()["choices"][0]["text"] == solo


@pytest.mark.slow
def test_a_burst_cannot_pass_the_waiting_limit(tiny_model):
    s = Server(tiny_model, "--served-model-name", "tiny", "--max-num-seqs", "1", "--max-waiting-requests", "4")
    long = {"model": "tiny", "prompt": "a b c", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        barrier = threading.Barrier(30)

        def one(client: httpx.Client):
            barrier.wait()
            response = client.send(client.build_request("POST", s.url + URL, json=long), stream=True)
            return response

        clients = [httpx.Client(timeout=60) for _ in range(30)]
        with concurrent.futures.ThreadPoolExecutor(30) as pool:
            responses = list(pool.map(one, clients))
        codes = [r.status_code for r in responses]
        for r, c in zip(responses, clients):
            r.close()
            c.close()
        # one runs, four wait: the other 25 are refused, however close together they came
        assert codes.count(200) <= 5 and codes.count(503) >= 25 and set(codes) <= {200, 503}, codes
        assert wait_until(lambda: s.metric("num_requests_running") == 0 and s.metric("num_requests_waiting") == 0, 30)
    finally:
        assert s.stop() == 0


def stalled(port: int, body_bytes: bool) -> socket.socket:
    """A connection that starts a request and stops: mid-headers, or with 1 of the 100 body bytes it declared."""
    sock = socket.create_connection(("127.0.0.1", port))
    if body_bytes:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
    else:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    sock.settimeout(20)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def still_open(sock: socket.socket) -> bool:
    """True while the server has neither answered nor closed the connection (looked at without waiting)."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(20)
    return False


@pytest.mark.slow
def test_stalled_clients_are_cut_off_connections_are_bounded_and_a_shutdown_tells_the_streams(tiny_model):
    s = Server(tiny_model, "--served-model-name", "tiny", "--request-read-timeout", "2", "--limit-concurrency", "12",
               "--max-num-seqs", "1", "--shutdown-timeout", "1")
    socks, more = [], []
    try:
        start = time.monotonic()
        socks = [stalled(s.port, body_bytes=i % 2 == 0) for i in range(10)]
        health = httpx.get(s.url + "/health", timeout=5)  # the 11th connection: still served, at once
        # at once: before the read timeout (2 s) cut any stalled connection off, not after
        assert health.status_code == 200 and all(still_open(sock) for sock in socks)
        more = [stalled(s.port, body_bytes=False) for _ in range(2)]  # 12 connections open
        time.sleep(0.3)
        assert httpx.get(s.url + "/health", timeout=5).status_code == 503  # past --limit-concurrency
        replies, closed_at = [], []
        for sock in socks + more:  # each ends within the read timeout
            replies.append(read_until_closed(sock))
            closed_at.append(time.monotonic() - start)
        # cut off together, about 2 s after they stalled (the last two 0.3 s later: ~1.2x the first); in turn, 12x
        assert closed_at[-1] < 4 * closed_at[0], closed_at
        for i, reply in enumerate(replies):
            if i % 2 == 1 or i >= 10:  # mid-headers: closed without a word (there is no request to answer)
                assert reply == b"", reply
            else:
                assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in reply, reply
        assert httpx.post(s.url + URL, json={"model": "tiny", "prompt": "a", "max_tokens": 2}).status_code == 200
        # SIGTERM while a long stream runs: past --shutdown-timeout it ends with an error event, then [DONE]
        body = {"model": "tiny", "prompt": "a b", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + URL, json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data:")
            s.proc.send_signal(signal.SIGTERM)
            events = [line[len("data: "):] for line in lines if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        assert "shut down before the request finished" in json.loads(events[-2])["error"]["message"], events[-2:]
        assert s.proc.wait(30) == 0
    finally:
        for sock in socks + more:
            sock.close()
        assert s.stop() == 0


@pytest.mark.slow
def test_a_short_hostile_soak(tiny_model):
    from minfer.lab.bench.hostile import hostile_soak

    result = hostile_soak(tiny_model, seconds=5, seed=1)
    assert result["ordinary_answers"] > 0 and result["hostile_actions"] > 0, result
    assert result["ordinary_mismatches"] == result["server_errors"] == result["dropped_connections"] == 0, result
    assert result["running_at_end"] == result["waiting_at_end"] == result["kv_cache_usage_at_end"] == 0, result
    assert result["status_codes"].get(400, 0) > 0, result  # the refused kinds were refused
