"""Fewer bytes per weight as speed, on a model of real size: random weights of Llama-3.1-8B's shapes, built on the
device (no file), decoded by the engine in bfloat16 and in each weight format, at batch 1 and 16.

    columns = real_size_decode("llama-3.1-8b", ("int8", "int4", "fp8"), (1, 16), device="cuda")

A decode step reads every weight once. For SmolLM2-135M that is 0.27 GB, a fraction of a millisecond of HBM
time, so on a GPU its step is bound by launches and the host, and a smaller format cannot show. An 8B model
reads 16 GB per step in bfloat16: there the bytes are the step, and int8 or int4 weights should make it
faster in proportion, if the kernels read them at full bandwidth. Speed depends on the shapes only, not on
what the weights say, so random weights measure it (the quality side is chapter 06's SmolLM2 evaluation).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence as Seq, Union

import torch

from minfer.config import EngineConfig
from minfer.engine.engine import Engine
from minfer.models.llama import LlamaModel
from minfer.outputs import RequestMetrics
from minfer.quant.linear import quantize_model
from minfer.sampling_params import SamplingParams
from minfer.sequence import Request, Sequence
from minfer.lab.testing import MODEL_SHAPES, word_tokenizer


def random_model(shape: str, dtype: torch.dtype, device: Union[str, torch.device], seed: int = 0) -> LlamaModel:
    """A LlamaModel of `shape` (a `MODEL_SHAPES` name) with normal(0, 0.02) weights drawn on the device."""
    torch.manual_seed(seed)
    model = LlamaModel.empty(MODEL_SHAPES[shape], dtype, device)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, 0.02)
    return model.eval()


def decode_tokens_per_s(engine: Engine, batch_size: int, prompt_len: int, max_tokens: int, seed: int = 0) -> float:
    """Greedy decode of max_tokens tokens for batch_size random prompts at once: output tokens per second of the
    decode steps (the prompts' prefill is left out), after one untimed run of the same shape (graphs recorded)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(100, vocab, (prompt_len,), generator=generator).tolist() for _ in range(batch_size)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for run in ("warm-up", "timed"):
        for i, ids in enumerate(prompts):
            seq = Sequence(ids, params, max_tokens, seed + i, RequestMetrics(time.perf_counter(), num_prompt_tokens=len(ids)))
            engine.add_request(Request(f"{run}-{i}", None, ids, [seq]))
        first_decode, decoded = None, 0
        while engine.has_unfinished_requests():
            engine.step()
            if first_decode is None:
                seqs = engine.snapshot(detail=True).sequences
                if all(s.num_output_tokens for s in seqs):
                    _sync(engine)
                    first_decode = time.perf_counter()  # every prompt is in: from here on, decode steps only
                    decoded = sum(s.num_output_tokens for s in seqs)
        _sync(engine)
    return (batch_size * max_tokens - decoded) / (time.perf_counter() - first_decode)


def _sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)


def real_size_decode(shape: str = "llama-3.1-8b", quantizations: Seq[str] = ("int8", "int4", "fp8"),
                     batch_sizes: Seq[int] = (1, 16), prompt_len: int = 64, max_tokens: int = 32,
                     device: Union[str, torch.device] = "cuda", dtype: torch.dtype = torch.bfloat16,
                     kv_cache_memory_bytes: int = 2 << 30, group_size: Optional[int] = None) -> dict[str, list]:
    """Decode tokens/s of dense weights ("none"), then of each weight format, at each batch size, and each
    against dense at the same batch.

    One model at a time is on the device: built, quantized (int4 in groups of group_size, default the largest
    of 32/64/128 that fits), timed at every batch size, then freed. The engine runs with its defaults for the
    device (CUDA graphs on CUDA), a KV pool of kv_cache_memory_bytes."""
    columns: dict[str, list] = {"weights": [], "batch": [], "tokens/s": [], "x dense": []}
    dense: dict[int, float] = {}
    tokenizer = word_tokenizer(MODEL_SHAPES[shape].vocab_size)
    for quantization in ("none", *quantizations):
        model = random_model(shape, dtype, device)
        if quantization != "none":
            quantize_model(model, quantization, group_size if quantization == "int4" else None)
        config = EngineConfig(device=str(device), dtype=dtype, max_num_seqs=max(batch_sizes),
                              max_model_len=prompt_len + max_tokens + 16, kv_cache_memory_bytes=kv_cache_memory_bytes)
        engine = Engine(model, tokenizer, config)
        for batch in batch_sizes:
            speed = decode_tokens_per_s(engine, batch, prompt_len, max_tokens)
            dense.setdefault(batch, speed)  # the first model timed is the dense one
            for name, value in (("weights", quantization), ("batch", batch), ("tokens/s", round(speed, 1)),
                                ("x dense", round(speed / dense[batch], 2))):
                columns[name].append(value)
        del engine, model
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return columns
