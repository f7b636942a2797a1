"""Bad input gets a ValueError that names what was wrong and what is allowed, and breaks nothing."""
import pytest

from minfer import LLM, SamplingParams


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=-3), "max_tokens must be an integer >= 1"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be an integer >= 1, or 0 / -1"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(n=10 ** 9), "n must be an integer >= 1 and at most 4096, got 1000000000"),  # not a billion sequences
    (dict(stop=[""]), "stop must be a non-empty string"),
    (dict(stop=5), "stop must be a non-empty string or a list of them, got 5"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a list of token ids \(integers >= 0\), got 5"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be a list of token ids"),
    (dict(seed=2 ** 64), r"seed must be None or an integer in \[-2\*\*63, 2\*\*63\)"),
    (dict(min_p=2), r"min_p must be in \[0, 1\]"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,message", [  # strict types, as OpenAI's API and vLLM: True is not 1, "2" not 2
    (dict(top_k=2.5), "top_k must be an integer, got float 2.5"),
    (dict(seed="abc"), "seed must be an integer, got str 'abc'"),
    (dict(temperature=True), "temperature must be a number, got bool True"),
    (dict(n=True), "n must be an integer, got bool True"),
    (dict(max_tokens="2"), "max_tokens must be an integer, got str '2'"),
    (dict(top_p="0.9"), "top_p must be a number, got str"),
    (dict(logprobs=True), "logprobs must be an integer, got bool"),
    (dict(ignore_eos=1), "ignore_eos must be True or False, got int 1"),
])
def test_sampling_params_of_the_wrong_type(kwargs, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)


def test_empty_prompt_rejected_and_engine_still_works(llm):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["Hello", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_prompt_longer_than_context_window(llm):
    too_long = {"prompt_token_ids": [42] * llm.max_model_len}
    with pytest.raises(ValueError, match=f"prompt 0 has {llm.max_model_len} tokens; the context window is"):
        llm.generate([too_long], use_tqdm=False)


def test_non_string_prompt(llm):
    with pytest.raises(ValueError, match="prompt 1 must be a string, .*got int"):
        llm.generate(["fine", 123], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate([], use_tqdm=False)
    for bad in ([1, 10**9], None, 5, "12", [True, 3]):  # not a list, a string, a bool among the ids
        with pytest.raises(ValueError, match="prompt 0: prompt_token_ids must be a non-empty list of ints"):
            llm.generate({"prompt_token_ids": bad}, use_tqdm=False)


def test_mismatched_sampling_params(llm):
    with pytest.raises(ValueError, match="got 2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params 0 must be a SamplingParams"):
        llm.generate("a", {"temperature": 0}, use_tqdm=False)


def test_bad_chat_messages(llm):
    with pytest.raises(ValueError, match="each message must be"):
        llm.chat([{"role": "user"}], use_tqdm=False)
    with pytest.raises(ValueError, match="content parts must be {'type': 'text', 'text': str}, got {'type': 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    with pytest.raises(ValueError, match="message 1 has the role 'wizard'; the roles are 'system', 'user'"):
        llm.chat([{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "x"}], use_tqdm=False)
    developer = llm.apply_chat_template([{"role": "developer", "content": "Be brief."}])
    assert developer == llm.apply_chat_template([{"role": "system", "content": "Be brief."}])


def test_a_temperature_too_small_for_the_softmax_is_raised_to_the_floor_and_the_batch_goes_on(llm):
    # 1e-45 divides the logits into infinities: NaN probabilities would fail the whole batch's sampling step
    with pytest.warns(UserWarning, match="temperature 1e-45 is below 0.01.*raised to 0.01"):
        tiny = SamplingParams(temperature=1e-45, max_tokens=4, seed=0)
    assert tiny.temperature == 0.01
    greedy = SamplingParams(temperature=0, max_tokens=4)
    both = llm.generate(["The capital of France is"] * 2, [greedy, tiny], use_tqdm=False)
    alone = llm.generate("The capital of France is", greedy, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in both] == ["length", "length"]
    assert both[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    # at 0.01 the top token is all but certain: the same tokens as greedy
    assert both[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_request_too_big_for_the_pool_names_its_prompt(tiny_dir):
    small = LLM(tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=4, block_size=16)
    small.generate("warm up the request counter", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt 1: request \d+ may need 201 tokens of KV cache"):
        small.generate(["Hi", "Hello"], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=200)], use_tqdm=False)
    assert not small.has_unfinished_requests() and small.engine.blocks.num_free_blocks == small.engine.blocks.num_blocks


def test_bad_engine_arguments():
    with pytest.raises(ValueError, match="unknown dtype 'float8'.*'bfloat16'"):
        LLM("smollm2-135m", dtype="float8")
    with pytest.raises(ValueError, match="unknown model"):
        LLM("gpt-17")
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        LLM("smollm2-135m", max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown device"):
        LLM("smollm2-135m", device="toaster")


@pytest.mark.slow
def test_max_model_len_bounds_generation():
    small = LLM("smollm2-135m", dtype="float32", device="cpu", max_model_len=12)
    out = small.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 12
    assert out.outputs[0].finish_reason == "length"


def test_a_context_the_model_lacks_fails_before_its_weights_load(monkeypatch, tiny_dir):
    """max_model_len is checked against the config alone: the error comes in a second, not after the load."""
    import gguf
    import safetensors.torch

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were read before the settings were checked")

    monkeypatch.setattr(gguf.quants, "dequantize", no_weights)
    monkeypatch.setattr(safetensors.torch, "load_file", no_weights)
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[1, 8192\] for this model"):
        LLM("smollm2-135m", max_model_len=10**6)
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[1, 256\] for this model"):
        LLM(tiny_dir, max_model_len=257)
