"""Sizing the KV pool from device memory (the CUDA path of ModelRunner._blocks_for_memory), checked on a CPU.

Its two pieces run anywhere: the profiling forward pass that measures a full step's activations, and the cap
at what the engine can ever fill (so that a second engine on the same GPU still finds room).
"""
import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.config import EngineConfig
from minfer.engine.model_runner import max_usable_blocks, profile_forward


def test_profile_forward_runs_a_step_longer_than_the_context(tiny_dir):
    """512 tokens in one step (several sequences' worth) on a model of 256 positions: positions wrap."""
    model = LLM(tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=4).model
    limit = model.config.max_position_embeddings
    assert limit < 512
    with pytest.raises(IndexError):  # what the pass did before: position 256 is past the rotary table
        model(torch.zeros(1, 512, dtype=torch.long), torch.arange(512)[None])
    profile_forward(model, 512, limit)


def config(**overrides) -> EngineConfig:
    values = dict(max_num_seqs=3, max_model_len=64, block_size=16)
    values.update(overrides)
    return EngineConfig(**values)


def test_max_usable_blocks_counts_sequences_and_lookahead():
    assert max_usable_blocks(config()) == 3 * 5  # 64 tokens + 1 to sample: 5 blocks of 16
    assert max_usable_blocks(config(max_num_seqs=8)) == 8 * 5
    assert max_usable_blocks(config(max_model_len=47)) == 3 * 3
    assert max_usable_blocks(config(speculative_model="[ngram]", num_speculative_tokens=16)) == 3 * 6


@pytest.mark.parametrize("case", ["one completion each", "n=3", "n-gram speculation"])
def test_a_pool_of_max_usable_blocks_never_preempts(tiny_dir, case):
    """max_num_seqs sequences, each to max_model_len, all at once, in the capped pool: nobody waits for a block,
    whether the sequences are separate requests, one request's n completions, or speculate k tokens ahead."""
    engine_args = dict(max_num_seqs=3, max_model_len=64, block_size=16)
    if case == "n-gram speculation":
        engine_args.update(speculative_model="[ngram]", num_speculative_tokens=4)
    blocks = max_usable_blocks(config(**engine_args))
    llm = LLM(tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=blocks, **engine_args)
    if case == "n=3":
        prompts = [{"prompt_token_ids": list(range(100, 140))}]
        params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=24, ignore_eos=True)
    else:
        prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(3)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(c.token_ids) for o in outputs for c in o.outputs] == [24, 24, 24]  # 40 + 24 = 64 tokens each
    assert llm.engine.scheduler.num_preemptions == 0
    if case == "one completion each":  # and the check can fail: a pool a third smaller makes someone wait
        small = LLM(tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=blocks * 2 // 3, **engine_args)
        small.generate(prompts, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
