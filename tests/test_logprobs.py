"""Logprobs through the public API: SamplingParams(logprobs, prompt_logprobs) against a direct forward pass."""
import math

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.logprobs import MAX_LOGPROBS

PROMPT = "The Python interpreter reads a program, splits it into tokens and then"


def direct_logprobs(llm, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position (row i predicts token i + 1)."""
    ids = torch.tensor([token_ids])
    logits = llm.model(ids, torch.arange(len(token_ids))[None], last_only=False)[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_entry(entry: dict, token: int, row: torch.Tensor, k: int) -> None:
    """One position's dict: the actual token first, then the top k by rank, all equal to the direct pass."""
    items = list(entry.items())
    assert items[0][0] == token
    top = row.topk(k)
    expected_top = top.indices.tolist()
    assert [t for t, _ in items[1:]] == [t for t in expected_top if t != token]  # top-k order
    assert len(entry) == k + (token not in expected_top)
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(row[t].item(), abs=2e-4)
        assert lp.rank == 1 + int((row > row[t]).sum())
    ranks_of_top = [entry[t].rank for t in expected_top]
    assert ranks_of_top == sorted(ranks_of_top) and ranks_of_top[0] == 1
    assert items[0][1].decoded_token is not None


def test_logprobs_equal_log_softmax_of_the_model(llm):
    k = 3
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=k, prompt_logprobs=k)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
    direct = direct_logprobs(llm, prompt + generated)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        check_entry(out.prompt_logprobs[i], prompt[i], direct[i - 1], k)
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(generated)
    for j, token in enumerate(generated):
        check_entry(completion.logprobs[j], token, direct[len(prompt) + j - 1], k)
        assert completion.logprobs[j][token].rank == 1  # greedy picks the top token
    total = sum(completion.logprobs[j][t].logprob for j, t in enumerate(generated))
    assert completion.cumulative_logprob == pytest.approx(total)
    assert completion.logprobs[0][generated[0]].decoded_token == llm.tokenizer.decode([generated[0]])


def test_logprobs_are_of_the_raw_distribution_when_sampling(llm):
    """Temperature and top-k shape the sampling, not the reported logprobs (vLLM's raw_logprobs)."""
    params = SamplingParams(temperature=1.5, top_k=5, seed=3, max_tokens=8, logprobs=5)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    direct = direct_logprobs(llm, out.prompt_token_ids + generated)
    for j, token in enumerate(generated):
        entry = out.outputs[0].logprobs[j]
        row = direct[len(out.prompt_token_ids) + j - 1]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=2e-4)
        assert entry[token].rank <= 5  # top_k=5 allowed only these
    assert any(out.outputs[0].logprobs[j][t].rank > 1 for j, t in enumerate(generated))  # it did sample


def test_zero_means_the_actual_token_only_and_none_means_off(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])
    assert [list(d) for d in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].logprobs is None
    assert plain.outputs[0].cumulative_logprob is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def assert_same(ours: list, theirs: list) -> None:
    """Same positions, same tokens in the same order, equal logprobs and ranks up to float noise
    (batching changes the sums' order: a token ranked 20000th may swap places with a neighbour)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert list(a) == list(b)
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
            assert abs(a[t].rank - b[t].rank) <= (0 if b[t].rank <= 100 else b[t].rank // 1000)


def test_prompt_logprobs_same_with_chunked_prefill_static_loop_and_prefix_cache(llm):
    prompt = PROMPT * 3  # ~45 tokens: several chunks of 16 and several cache blocks
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    whole = llm.generate(prompt, params, use_tqdm=False)[0]
    static = llm.generate(prompt, params, use_tqdm=False, batching="static")[0]
    scheduler = llm.engine.scheduler
    saved = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = 16
    try:
        chunked = llm.generate(prompt, params, use_tqdm=False)[0]
    finally:
        scheduler.max_num_batched_tokens = saved
    assert llm.engine.blocks.enable_prefix_caching
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # its blocks are now cached
    before = scheduler.cached_prompt_tokens
    cached_run = llm.generate(prompt, params, use_tqdm=False)[0]
    assert scheduler.cached_prompt_tokens == before  # no cache hit for a request that scores its prompt
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert scheduler.cached_prompt_tokens > before  # while other requests still hit the cache
    assert len(whole.prompt_logprobs) == len(whole.prompt_token_ids)
    for other in (static, chunked, cached_run):
        assert_same(other.prompt_logprobs, whole.prompt_logprobs)


def test_n_completions_share_one_prompt_logprobs(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3, logprobs=1, prompt_logprobs=1)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert [len(c.logprobs) for c in out.outputs] == [3, 3]


@pytest.mark.slow
def test_prompt_logprobs_survive_preemption(tiny_checkpoint):
    """A tight pool preempts requests mid-prefill: no position is scored twice or skipped."""
    folder = tiny_checkpoint(max_position_embeddings=1024)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (n,), generator=gen).tolist()}
               for n in (300, 200, 250, 180, 320, 150)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    roomy = LLM(folder, dtype="float32", device="cpu", num_gpu_blocks_override=512)
    expected = [roomy.generate(p, params, use_tqdm=False)[0] for p in prompts]
    tight = LLM(folder, dtype="float32", device="cpu", num_gpu_blocks_override=48, block_size=16,
                max_num_batched_tokens=128)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(got, expected):
        assert_same(a.prompt_logprobs, b.prompt_logprobs)
        assert_same(a.outputs[0].logprobs, b.outputs[0].logprobs)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value,error", [(-1, ValueError), (MAX_LOGPROBS + 1, ValueError), (1.5, TypeError),
                                         (True, TypeError), ("3", TypeError)])
def test_bad_logprobs_are_rejected(field, value, error):
    with pytest.raises(error, match=field):
        SamplingParams(**{field: value})


def test_max_logprobs_is_allowed(llm):
    out = llm.generate("Hi there", SamplingParams(max_tokens=1, logprobs=MAX_LOGPROBS), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) in (MAX_LOGPROBS, MAX_LOGPROBS + 1)
    assert math.isfinite(out.outputs[0].cumulative_logprob)
