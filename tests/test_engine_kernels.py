"""The engine on its Triton path (as on CUDA) gives the same tokens as its gather path, with the
KV pool in the model's dtype, in int8 and in fp8 (e4m3, its scales calibrated as the engine is built).

Run in a fresh process with TRITON_INTERPRET=1, so the kernels execute on the CPU under Triton's
interpreter; a tiny random model keeps it quick.
"""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import random, sys, tempfile
    from minfer import LLM, SamplingParams
    from minfer.lab.testing import random_checkpoint

    folder = random_checkpoint(tempfile.mkdtemp(), "tiny")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(1, 40))]} for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True) for _ in prompts]
    results = {}
    for use_kernels in (False, True):
        llm = LLM(folder, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=24,
                  num_gpu_blocks_override=40, kv_cache_dtype=sys.argv[1])
        llm.engine.runner.use_kernels = use_kernels
        results[use_kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # one request alone: steps of a single decode token (K and V then differ in a size-1 stride)
        results[use_kernels].append(llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                                 use_tqdm=False)[0].outputs[0].token_ids)
        assert llm.engine.stats.steps > 3 and llm.engine.blocks.num_free_blocks == 40
    assert results[True] == results[False], results
    print("kernel path == gather path:", sum(map(len, results[True])), "tokens")
""")


COMPILED_SCRIPT = textwrap.dedent("""
    import tempfile
    import torch
    from minfer import LLM, SamplingParams
    from minfer.lab.testing import tiny_moe_checkpoint, word_tokenizer

    folder = tempfile.mkdtemp()
    tiny_moe_checkpoint(folder, word_tokenizer(512), "qwen3", vocab_size=512)  # q/k norms: q is not laid out as the output
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 2 * i))} for i in range(2)]  # two decodes: bucket 2, no padding
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(folder, dtype="float32", device="cpu", num_gpu_blocks_override=32, enforce_eager=eager)
        llm.engine.runner.use_kernels = True
        with torch.no_grad():
            llm.model.norm.weight.mul_(30)  # random weights give nearly flat logits: make the argmax clear
        results[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert results[True] == results[False], results
    print("compiled == eager on the kernel path")
""")


@pytest.mark.slow
def test_compiled_decode_on_the_kernel_path_with_qk_norms():
    """torch.compile checks the custom attention op's output strides against its fake's: on the Triton path a
    Qwen3 model's attention output is laid out otherwise than its q (the fake's template), unless both are
    contiguous."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", COMPILED_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compiled == eager on the kernel path" in done.stdout


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_engine_kernel_path_matches_gather_path(kv_cache_dtype):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, kv_cache_dtype], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernel path == gather path" in done.stdout
