"""One completion being generated: its prompt, settings, tokens so far, and when to stop."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from minfer.detokenizer import IncrementalDetokenizer
from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minfer.sampling_params import SamplingParams


@dataclass(eq=False)  # compared by identity
class Sequence:
    """One completion being generated: a prompt, its settings, and the tokens so far."""

    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, capped by the context window
    seed: int  # its random stream (int64): the sampler draws output token i at (seed, i)
    metrics: RequestMetrics
    index: int = 0
    request_id: str = ""
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    # where it stands in the serving engine (unused by the static loop)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # found in the prefix cache when first admitted
    num_preemptions: int = 0
    # async scheduling (minfer.engine.overlap): tokens drawn on the device that the host has not read yet,
    # and where the newest of them is in its step's draws
    num_pending: int = 0
    pending_index: int = 0
    # speculative decoding: draft tokens this step's pass verifies (not output until accepted)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Optional[torch.Tensor] = None  # the draft's distributions [tokens, vocab]; None: one-hot guesses
    # log-probabilities, only when the request asks (None otherwise; see minfer.logprobs)
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    prompt_logprobs: Optional[list] = None  # on completion 0 only: the n completions share one prompt
    detokenizer: Optional[IncrementalDetokenizer] = field(default=None, repr=False)  # made at the first token
    grammar: Optional[object] = field(default=None, repr=False)  # structured outputs: its matcher (xgrammar)
    _generator: Optional[torch.Generator] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs = [None]  # the first prompt token has nothing before it

    @property
    def generator(self) -> torch.Generator:
        """A CPU generator seeded with `seed`, made when first asked for: speculative decoding's
        acceptance tests and draft samples, which run one sequence at a time, draw from it."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed % 2**64)
        return self._generator

    @property
    def needs_prompt_logits(self) -> bool:
        """Some prompt positions still lack their logprobs: their logits must be computed (no cache hits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def add_logprobs(self, entry: dict) -> None:
        """Record the logprobs of the token just sampled (appended by `append`)."""
        self.logprobs.append(entry)
        self.cumulative_logprob += next(iter(entry.values())).logprob  # the sampled token comes first

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output so far: what the cache must hold before the next token (a new list)."""
        return self.prompt_token_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """len(token_ids), without building the list (the engine asks every step)."""
        return len(self.prompt_token_ids) + len(self.output_ids)

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """(token_ids + spec_token_ids)[start:stop]: a step's input, without copying the whole sequence."""
        if stop == start + 1 == self.num_tokens:  # a plain decode step's input: the newest token (the usual case)
            return [self.output_ids[-1] if self.output_ids else self.prompt_token_ids[-1]]
        ids = []
        for part in (self.prompt_token_ids, self.output_ids, self.spec_token_ids):
            ids += part[max(0, start):max(0, stop)]
            start, stop = start - len(part), stop - len(part)
        return ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, tokenizer, eos_ids: set[int]) -> None:
        """Add a token, update the text, and decide whether the sequence is done."""
        now = time.perf_counter()
        if not self.output_ids:
            self.metrics.first_token_time = now
            self.detokenizer = IncrementalDetokenizer(tokenizer, self.params.skip_special_tokens,
                                                      self.params.text_each_step)
        self.output_ids.append(token)
        self.metrics.num_output_tokens = len(self.output_ids)
        p = self.params
        eos = not p.ignore_eos and token in eos_ids
        shaped = self.grammar is not None and self._advance_grammar(token)  # the shape is complete: it ends here
        stopped = eos or shaped or token in (p.stop_token_ids or ())
        # the token that stops a sequence stays in its token_ids but not in its text, as in vLLM
        if not stopped or p.include_stop_str_in_output:
            self.detokenizer.append(token)
        searched = len(self.text)
        # the last text is the full decode; until then a character split over tokens waits for its last byte
        last = stopped or len(self.output_ids) >= self.max_tokens
        self.text = self.detokenizer.flush() if last else self.detokenizer.text
        if stopped:  # stop_reason: None for the tokenizer's own EOS, else the token (vLLM's convention)
            self.finish_reason, self.stop_reason = "stop", None if eos and token == tokenizer.eos_token_id else token
        elif self._truncate_at_stop_string(searched):
            self.finish_reason = "stop"
        elif last:
            self.finish_reason = "length"
        if self.finished:
            self.metrics.finished_time = now

    def _advance_grammar(self, token: int) -> bool:
        """Move the structured-output matcher past `token`; True once it has reached its end."""
        if not self.grammar.accept_token(token):  # the mask allowed only tokens it accepts
            raise RuntimeError(f"token {token} does not fit the requested structured output")
        return self.grammar.is_terminated()

    def _truncate_at_stop_string(self, searched: int) -> bool:
        """End the text at the first stop string in it. The text before `searched` was searched at
        earlier tokens, so only a stop string ending in the new text can be there (each step costs the same)."""
        if not self.params.stop:
            return False
        hits = [(position, s) for s in self.params.stop_strings
                if (position := self.text.find(s, max(0, searched - len(s) + 1))) >= 0]
        if not hits:
            return False
        position, stop = min(hits)
        end = position + len(stop) if self.params.include_stop_str_in_output else position
        self.text, self.stop_reason = self.text[:end], stop
        return True

    def to_output(self) -> CompletionOutput:
        text = self.text
        if not text and self.detokenizer is not None and not self.detokenizer.every_token:
            text = self.detokenizer.flush()  # ended without a last token (aborted, failed): decoded now
        return CompletionOutput(self.index, text, list(self.output_ids), self.finish_reason, self.stop_reason,
                                None if self.logprobs is None else list(self.logprobs), self.cumulative_logprob)


@dataclass(eq=False)
class Request:
    """One prompt and its n completions (n > 1 only when SamplingParams.n asks for more)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # (a loop: the engine asks for every request every step, and all() costs 3x more)
            if seq.finish_reason is None:
                return False
        return True

    def to_output(self) -> RequestOutput:
        prompt_logprobs = self.seqs[0].prompt_logprobs
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [s.to_output() for s in self.seqs],
                             self.finished, self.seqs[0].metrics, None if prompt_logprobs is None else list(prompt_logprobs),
                             self.seqs[0].num_cached_prompt_tokens)
