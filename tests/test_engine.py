"""The serving engine: continuous batching equals solo runs, preemption, chunking, prefix caching, aborts."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minfer import SamplingParams
from minfer.sampling_params import RequestOutputKind


@pytest.fixture
def tiny_llm(make_tiny_llm):
    """tiny_llm(**engine_args) -> a new LLM over the 4096-position tiny model, max_model_len 256 unless given."""
    return lambda **engine_args: make_tiny_llm("4k", **{"max_model_len": 256, **engine_args})


def workload(n: int, max_prompt: int, max_out: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 49152) for _ in range(rng.randint(1, max_prompt))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, max_out), ignore_eos=True) for _ in range(n)]
    return prompts, params


def ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_continuous_batching_with_preemption_equals_solo(tiny_llm):
    """48 requests, prompts 1-600 tokens, outputs 1-300, a pool that forces preemption.

    The reference is the same 48 requests in a pool where nothing is preempted, and a sample of them
    run alone (all 48 alone took 7,000 steps, most of this test's time; batched equals solo is
    test_generation's subject)."""
    prompts, params = workload(48, 600, 300)
    roomy = tiny_llm(max_model_len=1024, num_gpu_blocks_override=2048)
    unpreempted = ids(roomy.generate(prompts, params, use_tqdm=False))
    assert roomy.engine.scheduler.num_preemptions == 0
    for i in range(0, 48, 6):
        assert roomy.generate(prompts[i], params[i], use_tqdm=False)[0].outputs[0].token_ids == unpreempted[i]
    tight = tiny_llm(max_model_len=1024, num_gpu_blocks_override=80, block_size=16,
                     max_num_batched_tokens=256, max_num_seqs=16)
    batched = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0  # the pool really was too small
    assert ids(batched) == unpreempted
    assert [len(t) for t in ids(batched)] == [p.max_tokens for p in params]
    assert tight.engine.blocks.num_free_blocks == 80  # every block came back


def test_static_batch_with_a_prompt_at_the_end_of_the_window(make_tiny_llm):
    # a finished row kept stepping its position: past the RoPE table once a full-window prompt shared the batch
    llm = make_tiny_llm()
    window = llm.max_model_len
    assert window == llm.config.max_position_embeddings  # the default, where the table ends with the window
    prompts = [{"prompt_token_ids": [3 + i % 500 for i in range(window - 1)]}, {"prompt_token_ids": [5, 6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    static = llm.generate(prompts, params, use_tqdm=False, batching="static")
    assert [len(t) for t in ids(static)] == [1, 5]
    assert ids(static) == ids(llm.generate(prompts, params, use_tqdm=False))
    assert ids(llm.generate(prompts, params, use_tqdm=False, batching="static", use_cache=False)) == ids(static)


@pytest.mark.slow
def test_real_model_continuous_equals_static_and_solo(llm):
    prompts = ["The capital of France is", "Write a haiku about autumn leaves.", "1, 2, 3, 4,", "def add(a, b):",
               "A long time ago in a galaxy far, far away, there lived"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (5, 30, 12, 20, 8)]
    continuous = llm.generate(prompts, params, use_tqdm=False)
    static = llm.generate(prompts, params, use_tqdm=False, batching="static")
    solo = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert ids(continuous) == ids(static) == ids(solo)


def test_chunked_prefill_splits_long_prompts(tiny_llm):
    prompts, params = workload(6, 200, 20, seed=1)
    whole = tiny_llm(max_num_batched_tokens=4096, enable_chunked_prefill=False, max_model_len=4096)
    chunked = tiny_llm(max_num_batched_tokens=32)
    assert ids(chunked.generate(prompts, params, use_tqdm=False)) == ids(whole.generate(prompts, params, use_tqdm=False))
    assert chunked.engine.stats.steps > whole.engine.stats.steps


def test_prefix_cache_skips_shared_prompt_blocks(tiny_llm):
    system = [1000 + i for i in range(128)]
    prompts = [{"prompt_token_ids": system + [2000 + i, 3000 + i]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=4)
    cached = tiny_llm(enable_prefix_caching=True)
    uncached = tiny_llm(enable_prefix_caching=False)
    first = cached.generate(prompts[:1], params, use_tqdm=False)  # warms the cache
    rest_cached = cached.generate(prompts[1:], params, use_tqdm=False)
    rest_plain = uncached.generate(prompts[1:], params, use_tqdm=False)
    assert ids(rest_cached) == ids(rest_plain)
    # the first request finds nothing; each of the 5 others finds the 128 shared tokens (8 full blocks) of its 130
    assert first and cached.engine.prefix_hit_rate == pytest.approx(5 * 128 / (6 * 130))
    assert uncached.engine.prefix_hit_rate == 0
    assert cached.engine.stats.computed_tokens < uncached.engine.stats.computed_tokens / 3

    assert cached.reset_prefix_cache()  # vLLM's: the next prompt is computed in full
    before = cached.engine.stats.computed_tokens
    assert ids(cached.generate(prompts[1:2], params, use_tqdm=False)) == ids(rest_plain[:1])
    assert cached.engine.stats.computed_tokens - before == 130 + 3  # the whole prompt, then 3 decode steps


def test_abort_frees_blocks_and_others_finish(tiny_llm):
    llm = tiny_llm(num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids_ = [llm.add_request({"prompt_token_ids": [500 + i] * 40}, params) for i in range(3)]
    llm.step()
    llm.abort_request(ids_[1])
    finished = []
    while llm.has_unfinished_requests():
        finished += [o.request_id for o in llm.step() if o.finished]
    assert sorted(finished) == sorted([ids_[0], ids_[2]])
    assert llm.engine.blocks.num_free_blocks == 64


def test_request_too_big_for_the_pool_is_rejected(tiny_llm):
    small = tiny_llm(num_gpu_blocks_override=4, block_size=4)
    with pytest.raises(ValueError, match="more than the whole pool"):
        small.generate({"prompt_token_ids": [7] * 10}, SamplingParams(max_tokens=20), use_tqdm=False)
    ok = small.generate({"prompt_token_ids": [7] * 5}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3 and small.engine.blocks.num_free_blocks == 4


def test_a_request_made_by_hand_is_held_to_max_model_len_and_its_id(tiny_llm):
    """The engine's own API checks what LLM checks (a Request built by hand beyond max_model_len would fail in the
    middle of a step, with the others in it); a clash of ids refuses the newcomer and leaves the holder running."""
    llm = tiny_llm(max_model_len=32, num_gpu_blocks_override=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    (long,) = llm._make_requests([{"prompt_token_ids": list(range(100, 130))}], [params])
    long.seqs[0].max_tokens = 20  # what LLM would have cut to 2
    with pytest.raises(ValueError, match="may reach 50 tokens .* more than max_model_len 32"):
        llm.engine.add_request(long)
    (holder,) = llm._make_requests([{"prompt_token_ids": [5] * 8}], [params])
    llm.engine.add_request(holder)
    llm._request_counter = int(holder.request_id)  # the next request LLM makes gets the holder's id
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request({"prompt_token_ids": [7] * 6}, params)
    while llm.has_unfinished_requests():
        llm.step()
    assert holder.seqs[0].finish_reason == "length" and len(holder.seqs[0].output_ids) == 20
    assert llm.engine.blocks.num_free_blocks == 64


def test_bad_engine_arguments(tiny_llm):
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        tiny_llm(block_size=0)
    with pytest.raises(ValueError, match="without chunked prefill, max_num_batched_tokens"):
        tiny_llm(enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="batching must be 'continuous' or 'static'"):
        tiny_llm().generate("hi", batching="dynamic")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_and_aborts_keep_the_pool_consistent(tiny_llm, data):
    llm = tiny_llm(num_gpu_blocks_override=data.draw(st.integers(12, 40)),
                   block_size=data.draw(st.sampled_from([2, 4, 8])),
                   max_num_batched_tokens=data.draw(st.sampled_from([8, 32, 128])),
                   max_num_seqs=data.draw(st.integers(1, 6)), enable_prefix_caching=data.draw(st.booleans()))
    engine, blocks = llm.engine, llm.engine.blocks
    live: list[dict] = []
    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["add", "add", "step", "step", "step", "abort"]))
        if action == "add":
            prompt = [data.draw(st.integers(100, 103))] * data.draw(st.integers(1, 20))
            (request,) = llm._make_requests({"prompt_token_ids": prompt},
                                            SamplingParams(temperature=0, max_tokens=data.draw(st.integers(1, 12)),
                                                           ignore_eos=True))
            if blocks.blocks_needed(len(prompt) + request.seqs[0].max_tokens) > blocks.num_blocks:
                with pytest.raises(ValueError, match="more than the whole pool"):
                    engine.add_request(request)  # refused up front, nothing queued
                continue
            engine.add_request(request)
            live.append(request)
        elif action == "abort" and live:
            engine.abort_request(live.pop(data.draw(st.integers(0, len(live) - 1))).request_id)
        elif engine.has_unfinished_requests():
            engine.step()
        blocks.check_invariants([s.block_table for s in engine.scheduler.running])
        assert all(not s.block_table for s in engine.scheduler.waiting)
    while engine.has_unfinished_requests():
        engine.step()
        blocks.check_invariants([s.block_table for s in engine.scheduler.running])
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(s.finished for r in live for s in r.seqs)


def test_pool_sized_from_a_memory_budget(tiny_llm):
    llm = tiny_llm(kv_cache_memory_bytes=10 * 2**20, block_size=8)
    per_block = 8 * 2 * 2 * 2 * 16 * 4  # 8 tokens x K and V x 2 layers x 2 KV heads x head_dim 16 x float32
    assert llm.engine.blocks.num_blocks == 10 * 2**20 // per_block
    assert llm.engine.runner.pool.nbytes == llm.engine.blocks.num_blocks * per_block
    with pytest.raises(ValueError, match="smaller than one block"):
        tiny_llm(kv_cache_memory_bytes=per_block - 1, block_size=8)


def test_a_failing_request_does_not_take_the_others_down(tiny_llm):
    llm = tiny_llm(num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    good = [llm.add_request({"prompt_token_ids": [300 + i] * 9}, params) for i in range(2)]
    bad = llm.add_request({"prompt_token_ids": [400] * 9}, params)
    broken = llm.engine.requests[bad].seqs[0]

    def explode(*args, **kwargs):
        raise RuntimeError("detokenizer exploded")

    broken.append = explode
    finished = {}
    while llm.has_unfinished_requests():
        finished.update({o.request_id: o for o in llm.step() if o.finished})
    assert finished[bad].outputs[0].finish_reason == "error"
    assert "detokenizer exploded" in finished[bad].outputs[0].stop_reason
    assert all(len(finished[g].outputs[0].token_ids) == 6 for g in good)
    assert llm.engine.blocks.num_free_blocks == 64


def test_aborting_unknown_or_finished_requests_is_harmless(tiny_llm):
    llm = tiny_llm(num_gpu_blocks_override=64)
    done = llm.generate({"prompt_token_ids": [5] * 4}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    llm.abort_request(done.request_id)
    llm.abort_request("no-such-request")
    assert llm.engine.blocks.num_free_blocks == 64 and not llm.has_unfinished_requests()


def test_final_only_requests_report_once_and_generate_asks_for_that(tiny_llm):
    """RequestOutputKind.FINAL_ONLY: no output until the request finishes, then the same one a CUMULATIVE request
    ends with; LLM.generate uses it on copies of the caller's parameters; DELTA is refused by name."""
    llm = tiny_llm()
    prompt = {"prompt_token_ids": [700 + i for i in range(12)]}
    each = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    once = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    every_id, once_id = llm.add_request(prompt, each), llm.add_request(prompt, once)
    reports = {every_id: [], once_id: []}
    while llm.has_unfinished_requests():
        for output in llm.step():
            reports[output.request_id].append(output)
    assert len(reports[every_id]) == 6 and [o.finished for o in reports[once_id]] == [True]
    last, final = reports[every_id][-1].outputs[0], reports[once_id][0].outputs[0]
    assert (final.text, final.token_ids, final.finish_reason) == (last.text, last.token_ids, last.finish_reason)
    assert final.text and len(final.token_ids) == 6

    (generated,) = llm.generate(prompt, each, use_tqdm=False)
    assert each.output_kind is RequestOutputKind.CUMULATIVE  # the caller's object is left as it was
    assert (generated.outputs[0].text, generated.outputs[0].token_ids) == (last.text, last.token_ids)
    with pytest.raises(ValueError, match="output_kind.*does not implement DELTA"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
    with pytest.raises(ValueError, match="output_kind must be"):
        SamplingParams(output_kind=2)
