"""Fuzzing, bounded in time: the server against its own OpenAPI schema (schemathesis), the library's
SamplingParams and prompts (hypothesis).

Whatever arrives, a client gets an answer below 500 and the server is clean afterwards (nothing
running, waiting or holding KV blocks); the library raises ValueError or TypeError, or generates.
"""
import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minfer import LLM, SamplingParams
from test_server import Server, wait_until

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed_server(tiny_dir):
    s = Server(tiny_dir, "--served-model-name", "tiny", "--max-num-seqs", "4", "--max-request-tokens", "2000")
    yield s
    assert s.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_body_gets_a_server_error(fuzzed_server, mode):
    """Bodies the schema allows (positive) and bodies it refuses (negative), on every operation."""
    schema = schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to get wrong in a GET without parameters

        @FUZZ
        @given(case=operation.as_strategy(mode))
        def answers_below_500(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text)

        answers_below_500()


@pytest.mark.slow
def test_the_server_is_clean_after_the_fuzzing(fuzzed_server):
    assert wait_until(lambda: fuzzed_server.metric("num_requests_running") == 0
                      and fuzzed_server.metric("num_requests_waiting") == 0
                      and fuzzed_server.metric("kv_cache_usage_perc") == 0, 30)
    reply = httpx.post(fuzzed_server.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 3}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- the library
VALID = {  # values SamplingParams takes, each mixed below with values of every kind
    "n": st.integers(1, 3), "temperature": st.floats(0, 3), "top_p": st.floats(5e-324, 1), "top_k": st.integers(-1, 60),
    "min_p": st.floats(0, 1), "seed": st.integers(-2 ** 63, 2 ** 63 - 1), "ignore_eos": st.booleans(),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3), "max_tokens": st.integers(1, 12),
    "logprobs": st.integers(0, 20), "prompt_logprobs": st.integers(0, 20),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-3, 24), st.sampled_from([2 ** 63, 10 ** 9, -2 ** 63 - 1]),
                      st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-300, 5e-324, 0.999999]),
                      st.text(max_size=3), st.lists(st.one_of(st.integers(-2, 600), st.text(max_size=2)), max_size=3))
PROMPTS = st.one_of(st.text(max_size=12), st.lists(st.integers(-2, 50_000), max_size=4),
                    st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(-2, 50_000), max_size=4)}),
                    st.lists(st.text(max_size=6), max_size=3), st.integers(), st.none())


GENERATED: list = []  # how many examples got as far as generating (the last test checks it is not none)


@pytest.fixture(scope="module")
def tiny_llm(make_tiny_llm) -> LLM:
    return make_tiny_llm(num_gpu_blocks_override=128)


@FUZZ
@given(settings_=st.builds(lambda valid, wild: {**valid, **wild}, st.fixed_dictionaries({}, optional=VALID),
                           st.dictionaries(st.sampled_from(sorted(VALID)), ANY_VALUE, max_size=1)),
       prompt=st.one_of(st.text(min_size=1, max_size=12), PROMPTS))
def test_the_library_refuses_clearly_or_generates(tiny_llm, settings_, prompt):
    try:
        outputs = tiny_llm.generate(prompt, SamplingParams(**settings_), use_tqdm=False)
    except (ValueError, TypeError) as exc:
        assert str(exc)  # a message that says what was wrong
    else:
        GENERATED.append(len(outputs))
        vocab = tiny_llm.model.config.vocab_size
        for output in outputs:
            for c in output.outputs:
                assert c.finish_reason in ("stop", "length") and all(0 <= t < vocab for t in c.token_ids)
    engine = tiny_llm.engine
    assert not engine.has_unfinished_requests() and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_the_library_fuzzing_reached_generation():
    assert len(GENERATED) >= 10, GENERATED
