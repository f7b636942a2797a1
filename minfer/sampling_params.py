"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from minfer.logprobs import MAX_LOGPROBS


@dataclass(kw_only=True)  # keywords only, as in vLLM (whose fields come in another order)
class SamplingParams:
    """The subset of vLLM's `SamplingParams` that minfer implements, with the same meanings.

    n: completions per prompt. temperature: 0 means greedy. top_p: keep the smallest set of
    tokens whose probability adds up to top_p. top_k: keep the k most likely (0 or -1: all).
    min_p: drop tokens below min_p x the top probability. seed: a private random stream for
    this request, so its samples do not depend on what else is in the batch. stop: strings that
    end the output (not included unless include_stop_str_in_output). stop_token_ids: extra
    tokens that end it (a stopping token, like end-of-sequence, is in token_ids but not in the
    text unless include_stop_str_in_output). ignore_eos: keep going past the end-of-sequence token.
    max_tokens: the most tokens to generate. logprobs: for each generated token, also return its
    log-probability and those of the `logprobs` most likely tokens (0: the sampled token only;
    None: nothing). prompt_logprobs: the same for every prompt token (see `minfer.logprobs`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        def bad(what: str, value, allowed: str) -> ValueError:
            return ValueError(f"{what} must be {allowed}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 (or None: up to the context window)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, value, f"None or an integer in [0, {MAX_LOGPROBS}] (0: only the chosen token)")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop", self.stop, "a non-empty string or a list of them")
        self.stop_strings = stops
        if self.stop_token_ids is not None and any(not isinstance(t, int) for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
