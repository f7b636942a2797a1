"""Chapter 00, worked: measure a generation before trying to speed it up.

A request has two phases with different bottlenecks. Prefill reads the whole prompt in one
pass (the user waits for it: TTFT). Decode then makes one token per pass, and each pass must
stream every weight from memory to the compute units (TPOT). For one request the decode
phase is limited by memory bandwidth, so the honest score for it is the share of the
hardware's bandwidth it uses.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from minfer import LLM, SamplingParams


def token_timestamps(llm: LLM, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """Generate `max_tokens` greedy tokens (ignoring end-of-sequence) with `llm.stream`.

    Returns (arrival, token_times): time.perf_counter() just before the request is made, and
    the time at which each token reached us, one entry per token.
    """
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    arrival = time.perf_counter()
    token_times = []
    for _ in llm.stream(prompt, params):  # stream yields once per new token
        token_times.append(time.perf_counter())
    return arrival, token_times


def ttft(arrival: float, token_times: Sequence[float]) -> float:
    """Time to first token, in seconds: from the request's arrival to its first token."""
    return token_times[0] - arrival


def tpot(token_times: Sequence[float]) -> float:
    """Time per output token, in seconds: the mean gap between tokens after the first.

    The first token is left out: its wait is prefill, which TTFT already counts.
    Raises ValueError for fewer than two tokens (there is no gap to measure).
    """
    if len(token_times) < 2:
        raise ValueError("TPOT needs at least two tokens")
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads, for a model with `embed_tokens` and `lm_head` (a LlamaModel).

    Every parameter counts once, even when two names share it (tied weights). The embedding
    table counts only when it is also the output head: on its own, a step reads one row of it.
    """
    bytes_by_tensor = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    embedding = model.embed_tokens.weight.data_ptr()
    if embedding != model.lm_head.weight.data_ptr():
        del bytes_by_tensor[embedding]  # untied: the lookup touches one row per token, not the table
    # tied (SmolLM2): the head multiplies by the whole table every step, so it stays, counted once
    return sum(bytes_by_tensor.values())


def bandwidth_utilization(model_bytes: int, tokens_per_second: float, bandwidth_bytes_per_s: float) -> float:
    """Model bandwidth utilisation (MBU): the fraction of memory bandwidth the decode phase uses.

    Each decode step of one sequence reads every weight once, so it moves
    model_bytes x tokens_per_second bytes a second. 1.0 would be the hardware's limit.
    """
    return model_bytes * tokens_per_second / bandwidth_bytes_per_s
