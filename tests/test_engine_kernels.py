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
    from minfer.testing import random_checkpoint

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


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_engine_kernel_path_matches_gather_path(kv_cache_dtype):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, kv_cache_dtype], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernel path == gather path" in done.stdout
