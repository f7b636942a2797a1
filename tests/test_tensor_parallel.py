"""Tensor parallelism (`minfer.engine.parallel`): N processes give the tokens and logits of one.

The tiny model is a float32 Qwen2-shaped model (q/k/v biases, so their slicing matters) with 8
query and 4 KV heads, so N = 2 and N = 4 both divide it. Each tensor-parallel LLM starts its
workers once (`tp_llm`), and one at a time: a process holds one torch.distributed group at a time.
"""
import dataclasses
import gc
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minfer import LLM, SamplingParams
from minfer.config import ModelConfig
from minfer.layers.parallel_linear import shard_model_config
from minfer.models.loader import load_model
from minfer.lab.testing import random_checkpoint, tiny_hf_checkpoint

ENGINE = dict(device="cpu", dtype="float32", num_gpu_blocks_override=48, block_size=8, max_num_seqs=6,
              max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=5, logprobs=5)


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory) -> str:
    words = random_checkpoint(str(tmp_path_factory.mktemp("tp_words")), "tiny")  # a word-level tokenizer of 512 ids
    folder = tmp_path_factory.mktemp("tp_qwen2")
    tiny_hf_checkpoint(folder, load_model(words).tokenizer, "qwen2", tie=False, vocab_size=512, hidden_size=64,
                       intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
    return str(folder)


def prompts() -> list[dict]:
    """12 prompts, pairs of them sharing a 16-token prefix (prefix caching), lengths 5 to 40."""
    shared = list(range(10, 26))
    return [{"prompt_token_ids": (shared if i % 2 else []) + [(7 * i + j) % 500 + 3 for j in range(5 + 2 * i)]}
            for i in range(12)]


@pytest.fixture(scope="module")
def reference(tp_dir):
    llm = LLM(tp_dir, **ENGINE)
    return llm, llm.generate(prompts(), GREEDY, use_tqdm=False)


LIVE: dict[int, LLM] = {}  # the one tensor-parallel LLM alive, by size


def close_live() -> None:
    for llm in LIVE.values():
        llm.engine.runner.workers.shutdown()
    LIVE.clear()


@pytest.fixture(scope="module", autouse=True)
def _close_at_end():
    yield
    close_live()


@pytest.fixture(scope="module", params=[2, 4])
def tp_size(request) -> int:
    """Module-scoped, so that pytest runs all the tests of one size before the next (one start each)."""
    return request.param


def tp_llm_of_size(n: int, folder: str) -> LLM:
    if n not in LIVE:
        close_live()
        LIVE[n] = LLM(folder, tensor_parallel_size=n, **ENGINE)
    return LIVE[n]


@pytest.fixture
def tp_llm(tp_size, tp_dir):
    """A tensor-parallel LLM of the tiny model, started once per size (after closing another size's)."""
    return tp_llm_of_size(tp_size, tp_dir)


def max_logprob_gap(a, b, same_top: bool = True) -> float:
    """The largest difference between two runs' logprobs, prompt and output, over every token both list
    (same_top: both list the same top tokens; else the tokens both list, the actual token always among them)."""
    gap = 0.0
    for x, y in zip(a, b):
        pairs = list(zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])) + list(zip(x.outputs[0].logprobs, y.outputs[0].logprobs))
        for px, py in pairs:
            assert set(px) == set(py) or not same_top
            gap = max(gap, max(abs(px[t].logprob - py[t].logprob) for t in set(px) & set(py)))
    return gap


def test_greedy_tokens_and_logprobs_equal_one_device(tp_llm, reference):
    """Continuous batching with chunked prefill and a pool small enough to preempt: the same as N=1."""
    _, expected = reference
    got = tp_llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert max_logprob_gap(got, expected) < 1e-4


def test_prefix_cache_hits_on_rank_0(tp_llm, reference):
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)  # prompt_logprobs take no cache hits
    before = tp_llm.engine.scheduler.cached_prompt_tokens
    got = tp_llm.generate(prompts(), plain, use_tqdm=False)
    assert tp_llm.engine.scheduler.cached_prompt_tokens > before
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids[:6] for o in reference[1]]


def test_all_reduces_two_per_layer_and_step(tp_llm):
    before = tp_llm.engine.snapshot()
    tp_llm.generate(prompts()[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    after = tp_llm.engine.snapshot()
    layers, hidden = tp_llm.config.num_layers, tp_llm.config.hidden_size
    new_steps = after.steps - before.steps
    new_rows = after.computed_tokens + after.padding_tokens - before.computed_tokens - before.padding_tokens
    was, now = before.communication, after.communication
    assert now.all_reduces - was.all_reduces == 2 * layers * new_steps
    assert now.all_reduce_bytes - was.all_reduce_bytes == 2 * layers * new_rows * hidden * 4  # float32 [rows, hidden] each
    assert now.all_reduce_seconds > 0 and now.broadcasts - was.broadcasts >= new_steps  # a message per step at least


@pytest.mark.parametrize("quantization", [pytest.param("int8", marks=pytest.mark.slow), "int4", "nf4"])
def test_quantized_shards(tp_dir, quantization):
    """Each shard quantized after slicing: close to the quantized one-device model (int4, nf4: groups within a
    shard are the same groups, int8: a row-parallel shard gets its own per-channel scales)."""
    args = dict(ENGINE, quantization=quantization)
    if quantization != "int8":
        args["quantization_group_size"] = 32
    one = LLM(tp_dir, **args).generate(prompts()[:4], GREEDY, use_tqdm=False)
    close_live()
    llm = LLM(tp_dir, tensor_parallel_size=2, **args)
    try:
        two = llm.generate(prompts()[:4], GREEDY, use_tqdm=False)
    finally:
        llm.engine.runner.workers.shutdown()
    assert max_logprob_gap(one, two, same_top=False) < 0.05


def test_bad_sizes_are_refused_before_any_process_starts(tp_dir):
    for n in (3, 8):
        with pytest.raises(ValueError, match=r"tensor_parallel_size=%d must divide .* one of \[1, 2, 4\]" % n):
            LLM(tp_dir, tensor_parallel_size=n, **ENGINE)
    for n in (0, -1, 2.0, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
            LLM(tp_dir, tensor_parallel_size=n, **ENGINE)
    smollm2 = ModelConfig(49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, 8192, True)
    with pytest.raises(ValueError, match=r"one of \[1, 3\]"):
        shard_model_config(smollm2, 2)
    assert shard_model_config(smollm2, 3).num_kv_heads == 1
    if "num_experts" in {f.name for f in dataclasses.fields(ModelConfig)}:
        moe = ModelConfig(512, 64, 128, 2, 8, 4, 8, 1e4, 1e-5, 256, True, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, sparse_layers=(1,))
        with pytest.raises(ValueError, match="does not support mixture-of-experts"):
            shard_model_config(moe, 2)
    for method in ("int4", "nf4"):  # 32 q features per shard: a block of 64 would straddle two ranks
        with pytest.raises(ValueError, match=f"{method} group size 64 does not divide a shard"):
            LLM(tp_dir, tensor_parallel_size=2, quantization=method, quantization_group_size=64, **ENGINE)
    refusals = [(dict(speculative_model="[ngram]", num_speculative_tokens=2), "speculative decoding"),
                (dict(quantization="awq"), "calibration"), (dict(enforce_eager=False), "compiled decode"),
                # without CUDA the device itself is refused first; with one GPU, tensor parallelism
                (dict(device="cuda", dtype="float32"), "needs 2 CUDA devices|sees no CUDA device")]
    for extra, message in refusals:
        if extra.get("device") == "cuda" and torch.cuda.device_count() >= 2:
            continue
        with pytest.raises(ValueError, match=message):
            LLM(tp_dir, tensor_parallel_size=2, **{**ENGINE, **extra})
    assert not mp.active_children()  # all refused before spawning


def test_static_batching_and_set_attention_refused(tp_llm):
    with pytest.raises(ValueError, match="serving engine"):
        tp_llm.generate(prompts()[:1], batching="static", use_tqdm=False)
    with pytest.raises(ValueError, match="pass attention= to LLM"):
        tp_llm.set_attention("reference")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_gone(pids: list[int], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def test_workers_exit_when_the_llm_is_collected(tp_size, tp_dir):
    """(After the other tests of its size, which share its LLM.)"""
    tp_llm_of_size(tp_size, tp_dir)
    llm = LIVE.pop(tp_size)
    pids = [p.pid for p in llm.engine.runner.workers.processes]
    assert all(alive(p) for p in pids)
    del llm
    gc.collect()
    assert wait_gone(pids)
    assert not dist.is_initialized()


SCRIPT = """
import os, sys, time
from minfer import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", num_gpu_blocks_override=16)
    print(" ".join(str(p.pid) for p in llm.engine.runner.workers.processes), flush=True)
    if sys.argv[2] == "kill":
        time.sleep(60)  # the test kills this process with SIGKILL: no atexit, no finalizer runs
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_no_orphans_after_exit_or_kill(tp_dir, tmp_path, how):
    """A script that simply ends (atexit), and one killed with SIGKILL (the workers watch their parent)."""
    script = tmp_path / "tp_child.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, str(script), tp_dir, how], stdout=subprocess.PIPE, text=True, env=env)
    pids = [int(p) for p in child.stdout.readline().split()]
    assert len(pids) == 1 and alive(pids[0])
    if how == "kill":
        child.kill()
    assert child.wait(timeout=60) in (0, -9)
    assert wait_gone(pids)


@pytest.mark.slow
def test_smollm2_three_ways_16_chats_equal_one(llm):
    """The real model, 9 query and 3 KV heads over 3 processes: 16 chat prompts through continuous batching."""
    questions = ["Why is the sky blue?", "Name a prime number.", "What is Python?", "Say hello in French.",
                 "What is 2 + 2?", "Who wrote Hamlet?", "What is a CPU?", "Give me a colour.",
                 "What is rain?", "Define entropy.", "What is a list?", "Name a planet.",
                 "What is tea?", "Why do cats purr?", "What is a byte?", "Spell 'cat'."]
    chats = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = llm.chat(chats, params, use_tqdm=False)
    close_live()
    tp = LLM("smollm2-135m", dtype="float32", device="cpu", tensor_parallel_size=3, max_num_seqs=16)
    try:
        got = tp.chat(chats, params, use_tqdm=False)
    finally:
        tp.engine.runner.workers.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
