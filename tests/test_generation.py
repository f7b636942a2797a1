"""Generation behaviour: batching, cache, seeds, stop conditions, streaming, chat."""
import copy
import dataclasses
import time

import pytest
import torch

from minfer import SamplingParams
from minfer.engine.engine import Engine

PROMPTS = ["The capital of France is", "Write a haiku about autumn leaves.", "1, 2, 3, 4,", "def add(a, b):"]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_batched_equals_solo(llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    batched = llm.generate(PROMPTS, params, use_tqdm=False)
    solo = [llm.generate(p, params, use_tqdm=False)[0] for p in PROMPTS]
    assert token_ids(batched) == token_ids(solo)


@pytest.mark.slow
def test_cache_and_no_cache_agree(llm):
    params = SamplingParams(temperature=0, max_tokens=16)
    assert token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == \
        token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False, use_cache=False))


@pytest.mark.slow
def test_seed_gives_the_same_sample_whatever_the_batch(llm):
    # ignore_eos: the prompt ends a reply with probability 0.29 at its first token, whatever the seed
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=5), seeded, SamplingParams(temperature=0.7, seed=7, max_tokens=30)]
    in_batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], others, use_tqdm=False)[1]
    assert in_batch.outputs[0].token_ids == alone.outputs[0].token_ids
    different_seed = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=20, ignore_eos=True),
                                  use_tqdm=False)[0]
    assert different_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_completions_differ_and_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12)
    first = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    again = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_max_tokens_and_length_finish(llm):
    start = time.perf_counter()
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    wall = time.perf_counter() - start
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    # TTFT + 6 TPOT is the request's timeline, arrival to last token: inside the call, and most of it
    assert out.metrics.num_output_tokens == 7 and wall / 3 < out.metrics.ttft + 6 * out.metrics.tpot <= wall


def test_stops_on_eos_unless_ignored(llm):
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == llm.tokenizer.eos_token_id
    assert "Paris" in chat.text and "<|im_end|>" not in chat.text
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=len(chat.token_ids) + 5, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == len(chat.token_ids) + 5


def test_stop_string_truncates_text(llm):
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0].text
    assert "7" in full
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, stop=["7"]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "7"
    assert out.text == full[:full.index("7")]
    kept = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, stop="7", include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[:full.index("7") + 1]
    # as in vLLM, stop is read when it is used: set after construction, it still counts (and a clone keeps it)
    later = SamplingParams(temperature=0, max_tokens=20)
    later.stop = ["7"]
    cloned = later.clone()
    later.stop = None
    assert llm.generate(PROMPTS[2], cloned, use_tqdm=False)[0].outputs[0].text == out.text
    assert llm.generate(PROMPTS[2], later, use_tqdm=False)[0].outputs[0].text == full


def test_stop_token_ids(llm):
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    stopper = full.token_ids[3]
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stopper]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:full.token_ids.index(stopper) + 1] and out.stop_reason == stopper
    # as in vLLM, the stopping token is in token_ids but not in the text, unless include_stop_str_in_output
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert out.text == decode(out.token_ids[:-1]) != decode(out.token_ids)
    kept = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stopper],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == decode(out.token_ids)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    raw = llm.chat(question, SamplingParams(temperature=0, max_tokens=60, skip_special_tokens=False), use_tqdm=False)
    assert raw[0].outputs[0].finish_reason == "stop" and not raw[0].outputs[0].text.endswith("<|im_end|>")


def test_stream_yields_growing_text_that_ends_like_generate(llm):
    params = SamplingParams(temperature=0, max_tokens=15)
    chunks = list(llm.stream(PROMPTS[0], params))
    assert len(chunks) == 15 or chunks[-1].finished
    texts = [c.outputs[0].text for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1].outputs[0].token_ids == llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    assert [c.finished for c in chunks].count(True) == 1


def test_stream_and_generate_beside_queued_requests(llm):
    """A stream ends with its own request, however long the requests queued beside it run; they advance in the
    same steps, and step() hands over their latest outputs, so their owner still sees them finish."""
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    queued = llm.add_request(PROMPTS[1], long)
    chunks = list(llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    assert len(chunks) == 3 and chunks[-1].finished and llm.has_unfinished_requests()  # the queued one still runs
    generated = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(generated[0].outputs[0].token_ids) == 4 and llm.has_unfinished_requests()
    seen = []
    while llm.has_unfinished_requests():
        seen += llm.step()
    assert seen and {o.request_id for o in seen} == {queued}
    (alone,) = llm.generate(PROMPTS[1], long, use_tqdm=False)
    assert seen[-1].finished and seen[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len([o for o in seen if o.finished]) == 1


def test_streams_read_in_turn_each_end_with_their_own_last_output(llm):
    """Two streams read in turn, with a generate() between their outputs: a request that finishes in a step
    another caller ran still reaches its own stream, finished, with generate's tokens."""
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (6, 2)]
    streams = [llm.stream(PROMPTS[0], params[0]), llm.stream(PROMPTS[2], params[1])]
    last = [next(stream) for stream in streams]
    llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    live = [0, 1]
    while live:
        for i in list(live):
            try:
                last[i] = next(streams[i])
            except StopIteration:
                live.remove(i)
    alone = llm.generate([PROMPTS[0], PROMPTS[2]], params, use_tqdm=False)
    assert all(out.finished for out in last)
    assert [out.outputs[0].token_ids for out in last] == token_ids(alone)
    assert not llm.has_unfinished_requests() and llm.step() == []


def test_token_id_prompts_and_request_fields(llm):
    ids = llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    by_ids = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    by_text = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == by_text.prompt_token_ids == ids
    assert by_text.prompt == PROMPTS[0] and by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_text.finished and by_text.outputs[0].text == llm.tokenizer.decode(by_text.outputs[0].token_ids)
    # vLLM's TextPrompt, {"prompt": text}, is the bare string, alone or mixed with others
    by_dict = llm.generate([{"prompt": PROMPTS[0]}, PROMPTS[1]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert by_dict[0].prompt == PROMPTS[0] and by_dict[0].prompt_token_ids == ids
    assert by_dict[0].outputs[0].token_ids == by_text.outputs[0].token_ids


def test_chat_content_may_be_text_parts(llm):
    # OpenAI's content lists: the text parts joined by newlines, as vLLM joins them
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]}]
    plain = [{"role": "user", "content": "Name a colour.\nOne word."}]
    assert llm.chat_prompt(parts) == llm.chat_prompt(plain)
    params = SamplingParams(temperature=0, max_tokens=6)
    assert llm.chat(parts, params, use_tqdm=False)[0].outputs[0].token_ids == \
        llm.chat(plain, params, use_tqdm=False)[0].outputs[0].token_ids


def test_num_cached_tokens_counts_the_prefix_cache_hits(llm):
    block = llm.engine.config.block_size
    prompt = {"prompt_token_ids": list(range(1000, 1000 + 2 * block + block // 2))}  # two whole blocks and a half
    params = SamplingParams(temperature=0, max_tokens=2)
    assert llm.engine.config.enable_prefix_caching
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0  # never seen: nothing cached
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 2 * block  # the whole blocks


def test_small_batches_give_the_same_result(llm):
    params = SamplingParams(temperature=0, max_tokens=10)
    big = llm.generate(PROMPTS, params, use_tqdm=False)
    small = copy.copy(llm)  # the same model behind an engine that runs at most two sequences per step
    small.engine = Engine(llm.model, llm.tokenizer, dataclasses.replace(llm.engine.config, max_num_seqs=2,
                                                                         num_gpu_blocks_override=64))
    assert token_ids(big) == token_ids(small.generate(PROMPTS, params, use_tqdm=False))
    assert token_ids(big) == token_ids(small.generate(PROMPTS, params, use_tqdm=False, batching="static"))


@pytest.mark.slow
def test_bfloat16_model_generates_sensible_text():
    from minfer import LLM

    llm16 = LLM("smollm2-135m", dtype="bfloat16", device="cpu")
    assert llm16.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm16.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_text_prompts_get_the_tokenizers_bos_and_chat_prompts_no_second_one(tmp_path):
    """As vLLM (and transformers' tokenizer(text)): a text prompt is encoded with the special tokens its tokenizer
    adds (a Llama tokenizer's BOS); a chat template writes its own BOS, so its text is encoded without them."""
    import shutil

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from minfer import LLM
    from minfer.lab.testing import random_checkpoint

    folder = random_checkpoint(str(tmp_path / "bos"), "tiny", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.chat_template = "<s>{% for m in messages %}{{ m['content'] }} {% endfor %}"
    shutil.rmtree(folder + "/tokenizer.json", ignore_errors=True)
    tokenizer.save_pretrained(folder)
    llm = LLM(folder, dtype="float32", device="cpu", num_gpu_blocks_override=16)
    t5, t6 = tokenizer.convert_tokens_to_ids(["t5", "t6"])
    greedy = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate("t5 t6", greedy, use_tqdm=False)[0].prompt_token_ids == [bos, t5, t6]
    chat = llm.chat([{"role": "user", "content": "t5 t6"}], greedy, use_tqdm=False)[0]
    assert chat.prompt_token_ids == [bos, t5, t6] and chat.prompt.startswith("<s>t5 t6")


def test_generation_config_eos_tokens_end_a_sequence(tmp_path, random_tiny_dir):
    """A checkpoint's generation_config.json may list end-of-sequence tokens beyond the tokenizer's (Llama-3 and
    Qwen2.5 instruct models do): generation stops at any of them, as in vLLM and transformers."""
    import json
    import shutil

    from minfer import LLM

    folder = tmp_path / "model"
    shutil.copytree(random_tiny_dir, folder)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    greedy = SamplingParams(temperature=0, max_tokens=8)
    free = LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=16).generate(
        prompt, greedy, use_tqdm=False)[0].outputs[0]
    stopper = free.token_ids[2]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stopper]}))
    out = LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=16).generate(
        prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:free.token_ids.index(stopper) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stopper  # vLLM folds these into stop_token_ids
    from minfer.quant.checkpoint import quantize_checkpoint

    quantized = quantize_checkpoint(str(folder), "int8", str(tmp_path / "int8"))  # a saved checkpoint keeps them
    assert stopper in LLM(quantized, dtype="float32", device="cpu", num_gpu_blocks_override=16).engine.eos_token_ids
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a list"):
        LLM(str(folder), dtype="float32", device="cpu")
