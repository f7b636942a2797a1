"""Step shapes in buckets (minfer/engine/buckets.py): padding changes no result, and bounds the shapes."""
import random

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.engine.buckets import TOKEN_BUCKETS, bucket_for


def test_bucket_for():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 9, 16, 17, 25, 100, 500, 512)] == [1, 2, 4, 8, 16, 16, 24, 32, 112, 512, 512]
    assert [bucket_for(n) for n in (513, 768, 769)] == [768, 768, 1024]
    assert list(TOKEN_BUCKETS) == sorted(set(TOKEN_BUCKETS))
    for n in range(17, 513):  # above 16 tokens a bucket pads by at most a third of what it holds
        assert n <= bucket_for(n) <= max(n * 4 // 3 + 1, 24)
    with pytest.raises(ValueError, match="at least one token"):
        bucket_for(0)


def run(folder: str, bucket: bool, prompts, params):
    llm = LLM(folder, dtype="float32", device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=40,
              bucket_step_shapes=bucket)
    with torch.no_grad():
        llm.model.norm.weight.mul_(30)  # random weights give nearly flat logits: make the argmax clear
    shapes = set()
    forward = llm.model.forward

    def spy(input_ids, *args, **kwargs):
        shapes.add(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    llm.model.forward = spy
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, shapes, llm.engine.stats


def test_padded_steps_give_the_same_tokens_and_logprobs(random_tiny_dir):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(rng.randint(3, 30))]} for _ in range(9)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 12), ignore_eos=True, logprobs=1) for _ in prompts]
    exact, exact_shapes, exact_stats = run(random_tiny_dir, False, prompts, params)
    padded, padded_shapes, padded_stats = run(random_tiny_dir, True, prompts, params)
    for a, b in zip(exact, padded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert [lp.logprob for lp in x.values()] == pytest.approx([lp.logprob for lp in y.values()], abs=1e-5)
    assert padded_shapes <= set(TOKEN_BUCKETS)
    assert len(exact_shapes) > len(padded_shapes)  # the point: fewer distinct shapes
    assert exact_stats.padding_tokens == 0 < padded_stats.padding_tokens
    assert exact_stats.computed_tokens == padded_stats.computed_tokens  # padding is not counted as work done
