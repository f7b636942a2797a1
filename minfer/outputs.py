"""What generate() returns: vLLM's RequestOutput / CompletionOutput, plus timing metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from minfer.logprobs import Logprob

# vLLM's shapes: one {token id: Logprob} dict per generated token; per prompt token, with None
# for the first (nothing comes before it to predict it from)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class RequestMetrics:
    """When things happened to one request (time.perf_counter seconds) and what follows.

    TTFT (time to first token) is the prefill phase as the user feels it; TPOT (time per output
    token, after the first) is the decode phase. Measuring them apart is lesson one.
    """

    arrival_time: float
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def tokens_per_second(self) -> Optional[float]:
        tpot = self.tpot
        return None if not tpot else 1.0 / tpot


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" (EOS or stop string) or "length"
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    logprobs: Optional[SampleLogprobs] = None  # when SamplingParams.logprobs is set
    cumulative_logprob: Optional[float] = None  # sum of the generated tokens' logprobs (same condition)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
    prompt_logprobs: Optional[PromptLogprobs] = None  # when SamplingParams.prompt_logprobs is set
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (chapter 05), as vLLM counts them
