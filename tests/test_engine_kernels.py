"""The engine on its Triton path (as on CUDA) gives the same tokens as its gather path.

Run in a fresh process with TRITON_INTERPRET=1, so the kernels execute on the CPU under Triton's
interpreter; a tiny random model keeps it quick.
"""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import random, tempfile
    from minfer import LLM, SamplingParams
    from minfer.benchmark import random_checkpoint

    folder = random_checkpoint(tempfile.mkdtemp(), "tiny")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(1, 40))]} for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True) for _ in prompts]
    results = {}
    for use_kernels in (False, True):
        llm = LLM(folder, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=24,
                  num_gpu_blocks_override=40)
        llm.engine.use_kernels = use_kernels
        results[use_kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.stats.steps > 3 and llm.engine.blocks.num_free_blocks == 40
    assert results[True] == results[False], results
    print("kernel path == gather path:", sum(map(len, results[True])), "tokens")
""")


def test_engine_kernel_path_matches_gather_path():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kernel path == gather path" in done.stdout
