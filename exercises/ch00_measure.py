"""Chapter 00: measure a generation before trying to speed it up.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch00")` in the
notebook. Prefill (the whole prompt in one pass) decides the time to the first token; decode
(one pass per token, each streaming every weight from memory) decides the time per token.
"""
from __future__ import annotations

import time  # noqa: F401  (time.perf_counter: for token_timestamps)
from typing import Sequence

import torch

from minfer import LLM, SamplingParams  # noqa: F401  (SamplingParams: for token_timestamps)


def token_timestamps(llm: LLM, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """Generate `max_tokens` greedy tokens (ignoring end-of-sequence) with `llm.stream`.

    Returns (arrival, token_times): time.perf_counter() just before the request is made, and
    the time at which each token reached us, one entry per token.
    """
    raise NotImplementedError("write me")


def ttft(arrival: float, token_times: Sequence[float]) -> float:
    """Time to first token, in seconds: from the request's arrival to its first token."""
    raise NotImplementedError("write me")


def tpot(token_times: Sequence[float]) -> float:
    """Time per output token, in seconds: the mean gap between tokens after the first.

    The first token is left out: its wait is prefill, which TTFT already counts.
    Raises ValueError for fewer than two tokens (there is no gap to measure).
    """
    raise NotImplementedError("write me")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads, for a model with `embed_tokens` and `lm_head` (a LlamaModel).

    Every parameter counts once, even when two names share it (tied weights). The embedding
    table counts only when it is also the output head: on its own, a step reads one row of it.
    """
    raise NotImplementedError("write me")


def bandwidth_utilization(model_bytes: int, tokens_per_second: float, bandwidth_bytes_per_s: float) -> float:
    """Model bandwidth utilisation (MBU): the fraction of memory bandwidth the decode phase uses.

    Each decode step of one sequence reads every weight once, so it moves
    model_bytes x tokens_per_second bytes a second. 1.0 would be the hardware's limit.
    """
    raise NotImplementedError("write me")
