"""The compiled decode step (enforce_eager=False) gives the eager step's logits and greedy tokens in float32."""
import random

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.engine.buckets import bucket_for


def sharpened(folder: str, enforce_eager: bool) -> LLM:
    llm = LLM(folder, dtype="float32", device="cpu", num_gpu_blocks_override=64, enforce_eager=enforce_eager)
    with torch.no_grad():
        llm.model.norm.weight.mul_(30)  # random weights give nearly flat logits: make the argmax clear
    return llm


@pytest.mark.slow
@pytest.mark.parametrize("num_seqs", [1, 3])  # bucket 1, and 3 real rows padded to 4
def test_compiled_step_logits_equal_eager(random_tiny_dir, num_seqs):
    llm = sharpened(random_tiny_dir, enforce_eager=False)
    runner = llm.engine.runner
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(num_seqs):
        llm.add_request({"prompt_token_ids": list(range(10 + i, 30 + 3 * i))}, params)
    for _ in range(3):  # past the prompts: every sequence decodes
        llm.step()
    step = runner.prepare(llm.engine.scheduler.schedule())
    assert step.plain_decode and step.input_ids.shape[1] == bucket_for(num_seqs)  # padded by the runner
    eager = llm.model(step.input_ids, step.positions, step.paged, logits_indices=step.logits_indices)
    assert runner.decode_step.serves(step)
    compiled, hidden = runner.decode_step(step)
    assert hidden is None
    assert compiled.shape == eager.shape[1:] == (bucket_for(num_seqs), 512)
    torch.testing.assert_close(compiled, eager[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_and_eager_generate_the_same_tokens(random_tiny_dir):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(2, 30))]} for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 12), ignore_eos=True) for _ in prompts]
    tokens, calls = {}, []
    for eager in (True, False):
        llm = sharpened(random_tiny_dir, eager)
        if not eager:
            compiled = llm.engine.runner.decode_step
            compiled.forward = lambda ids, positions, run=compiled.forward: calls.append(ids.shape[1]) or run(ids, positions)
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[True] == tokens[False]
    assert len(calls) >= 8 and max(calls) == 8  # the decode steps, five sequences at most (bucket 8), went through it
