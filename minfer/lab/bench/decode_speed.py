"""Decode speed against its memory bound, measured one way for notebook 00, the benchmarks and the tests.

At batch 1, a decode step multiplies one vector by every weight matrix of the model, so its speed
is bounded by how fast those weights stream in from memory, not by arithmetic. Three numbers make
that visible and are measured the same way everywhere:

* `measure_memory_bandwidth()`: what a large copy achieves (bytes read + written per second);
* `weight_bytes(model)`: the bytes of weights one decode step has to read;
* `matmul_floor(model, ...)`: the same matrix multiplications a decode step makes, on the same
  weights, with nothing around them: the speed an engine would reach with zero overhead.

Model bandwidth utilisation (MBU) = weight bytes per step / TPOT / bandwidth: the share of the
memory system a decode step keeps busy. `time_minfer` times the engine itself: greedy decoding of a
fixed number of tokens (EOS ignored) on token-id prompts from `make_prompts`, after a warm-up.
"""
from __future__ import annotations

import statistics
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from minfer.lab.bench.common import best_time, dtype_name
from minfer.lab.bench.timing import Timing

TokenIds = list[int]


def model_bandwidth_utilisation(bytes_per_step: int, tpot_s: float, bandwidth: float) -> float:
    """Share of the memory bandwidth one decode step uses to read its bytes.

    Every step reads all weights once, whatever the batch size, so the step time (TPOT) is what
    counts: at batch 1 this equals weight bytes x tokens/s / bandwidth. Pass the weights alone, or
    the weights plus the K/V the step reads (`decode_kv_bytes`): at large batches the K/V can
    outweigh the weights.
    """
    return bytes_per_step / tpot_s / bandwidth


def decode_kv_bytes(kv_bytes_per_token: int, batch: int, prompt_tokens: int, new_tokens: int) -> float:
    """K/V bytes an average decode step reads while `batch` sequences each generate `new_tokens` after their prompts.

    The prefill makes the first new token; decode step j (1 to new_tokens - 1) attends over
    prompt_tokens + j tokens per sequence, so the mean context is prompt_tokens + new_tokens / 2.
    """
    mean_context = prompt_tokens + new_tokens / 2
    return batch * mean_context * kv_bytes_per_token


# --------------------------------------------------------------------------- the hardware side

def measure_memory_bandwidth(size_mb: int = 256, repeats: int = 5, device: Union[str, torch.device] = "cpu") -> float:
    """Bytes per second a large tensor copy achieves (read + write), best of `repeats`.

    Pick `size_mb` well above the last-level cache, or the cache is what gets measured.
    """
    n = size_mb * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once: the first write to fresh memory is slow
    return 2 * src.nbytes / best_time(lambda: dst.copy_(src), repeats, device)


def decode_linears(model) -> list[torch.nn.Module]:
    """The linear layers one decode step runs, in order (as minfer's LlamaModel makes them)."""
    linears = []
    for layer in model.layers:
        linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return linears + [model.lm_head]


def decode_weights(model) -> list[torch.Tensor]:
    """The weight matrices one decode step multiplies by, in order."""
    return [linear.weight for linear in decode_linears(model)]


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every matrix and norm, each shared tensor once.

    The embedding table is not read in full (one row per token) unless it is also the output
    head, as in tied models like SmolLM2, where the head reads all of it.
    """
    seen, total = set(), 0
    head = model.lm_head.weight.data_ptr()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name.startswith("embed_tokens") and p.data_ptr() != head:
            continue
        total += p.numel() * p.element_size()
    return total


@torch.inference_mode()
def matmul_floor(model, batch_size: int = 1, steps: int = 32, warmup: int = 3, repeats: int = 3,
                 plain: bool = False) -> Timing:
    """Time only the matrix multiplications a decode step makes, on the model's own weights.

    By default it calls the model's own linear layers (on CPU minfer's are prepacked for oneDNN,
    `minfer.layers.linear`): nothing but the engine's overhead separates the engine from this.
    plain=True calls F.linear on the weights instead, what an engine without prepacking runs.
    Returns a Timing whose TPOT is the best step time over `repeats` runs of `steps` steps: no
    engine with these matmuls decodes faster without reading fewer bytes (an upper bound on tokens/s).
    On CUDA the step is captured once as a CUDA graph and replayed: launched one by one from Python, 121
    small matmuls take longer to launch than a GPU takes to read their weights, and the floor would time
    Python (if capture fails, they are launched one by one, as the engine launches them).
    """
    linears = decode_linears(model)
    weight = linears[0].weight
    device, dtype = weight.device, weight.dtype
    inputs = {m.in_features: torch.randn(batch_size, 1, m.in_features, dtype=dtype, device=device) for m in linears}
    calls = [(lambda x, w=m.weight: F.linear(x, w)) if plain else m for m in linears]

    @torch.inference_mode()
    def step() -> None:
        for linear, call in zip(linears, calls):
            call(inputs[linear.in_features])

    def run() -> None:
        for _ in range(steps):
            step()

    if device.type == "cuda":
        side = torch.cuda.Stream()  # warm up off the default stream, as CUDA-graph capture wants
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()

            def run() -> None:
                for _ in range(steps):
                    graph.replay()
        except RuntimeError as exc:  # something in the step cannot be captured: time the launches themselves
            print(f"matmul floor: no CUDA graph ({str(exc).splitlines()[0]}); timing eager launches")
    else:
        for _ in range(warmup):
            step()
    best = best_time(run, repeats, device) / steps
    return Timing("F.linear floor" if plain else "matmul floor", dtype_name(dtype), batch_size, None, best, steps)


def make_prompts(vocab_size: int, num_prompts: int, prompt_len: int, seed: int = 0, low: int = 100) -> list[TokenIds]:
    """`num_prompts` different prompts of exactly `prompt_len` random token ids (no padding needed).

    Token ids, not text: both engines then see exactly the same input, and a model without a
    real tokenizer (random weights on a GPU machine) can be benchmarked too. Ids below `low`
    are skipped (special tokens live there).
    """
    gen = torch.Generator().manual_seed(seed)
    low = min(low, vocab_size // 2)
    return torch.randint(low, vocab_size, (num_prompts, prompt_len), generator=gen).tolist()


def batch_of(prompts: Sequence[TokenIds], batch_size: Optional[int]) -> list[TokenIds]:
    """`batch_size` rows (default: one per prompt), the prompts repeated in turn when there are fewer."""
    if not prompts:
        raise ValueError("give at least one prompt")
    batch_size = batch_size or len(prompts)
    return [list(prompts[i % len(prompts)]) for i in range(batch_size)]


def as_token_ids(prompt: Union[str, TokenIds], tokenizer) -> TokenIds:
    """A prompt as token ids: text is encoded without special tokens, ids are copied."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=False)
    return list(prompt)


def time_minfer(llm, prompts: Sequence[Union[str, TokenIds]], max_tokens: int = 32, batch_size: Optional[int] = None,
                warmup: bool = True) -> Timing:
    """Greedy-decode exactly `max_tokens` tokens for `batch_size` prompts in one batch with minfer.

    TTFT and TPOT come from the engine's own per-request metrics (averaged over the batch).
    The generated ids are in `timing.extra["token_ids"]`.
    """
    from minfer.sampling_params import SamplingParams

    if max_tokens < 2:
        raise ValueError("max_tokens must be >= 2: TPOT needs a token after the first")
    batch = batch_of([as_token_ids(p, llm.tokenizer) for p in prompts], batch_size)
    requests = [{"prompt_token_ids": ids} for ids in batch]
    scheduler, blocks = llm.engine.scheduler, llm.engine.blocks
    saved = scheduler.max_num_seqs, blocks.enable_prefix_caching
    # The whole batch runs together, and every prompt is computed in full: with the prefix cache on,
    # the warm-up (or an earlier repeat) would leave the prompts cached and TTFT would measure nothing.
    scheduler.max_num_seqs, blocks.enable_prefix_caching = max(saved[0], len(batch)), False
    try:
        if warmup:
            llm.generate(requests, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(requests, params, use_tqdm=False)
    finally:
        scheduler.max_num_seqs, blocks.enable_prefix_caching = saved
    counts = {o.metrics.num_output_tokens for o in outputs}
    if counts != {max_tokens}:
        raise RuntimeError(f"minfer generated {sorted(counts)} tokens per sequence, expected {max_tokens}")
    ttft = statistics.mean(o.metrics.ttft for o in outputs)
    tpot = statistics.mean(o.metrics.tpot for o in outputs)
    return Timing("minfer", dtype_name(llm.dtype), len(batch), ttft, tpot, max_tokens, len(batch[0]),
                  extra={"token_ids": [o.outputs[0].token_ids for o in outputs]})
