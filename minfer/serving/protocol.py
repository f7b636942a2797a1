"""OpenAI's request and response shapes, as the official client and vLLM's server use them.

Requests are pydantic models: a field of the wrong type, a value out of range or a field that
does not exist becomes a 400 with OpenAI's error body naming it. The sampling fields map onto
`SamplingParams` (vLLM's extras `top_k`, `min_p`, `ignore_eos`, ... included), whose own checks
give the same 400 for a value it refuses.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from minfer.logprobs import MAX_LOGPROBS, Logprob
from minfer.outputs import CompletionOutput, RequestOutput
from minfer.sampling_params import SamplingParams, StructuredOutputsParams


class _Strict(BaseModel):
    # a misspelled field is an error, not silently ignored; types are strict, as in OpenAI's API: true is not 1, "2" not 2
    model_config = ConfigDict(extra="forbid", strict=True)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, beyond the schema: each excess is a 400 naming the server flag."""

    max_n: int = 128  # completions per prompt (OpenAI's own limit)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 256

    def check(self, body: "_Sampling") -> None:
        def over(what: str, value: int, limit: int, flag: str) -> ValueError:
            return ValueError(f"{what} is {value}; this server allows at most {limit} (its {flag})")

        if body.n > self.max_n:
            raise over("n", body.n, self.max_n, "--max-n")
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        if len(stops) > self.max_stop_strings:
            raise over("the number of stop strings", len(stops), self.max_stop_strings, "--max-stop-strings")
        longest = max(map(len, stops), default=0)
        if longest > self.max_stop_string_chars:
            raise over("the longest stop string's length", longest, self.max_stop_string_chars,
                       "--max-stop-string-chars")
        if len(body.stop_token_ids or ()) > self.max_stop_token_ids:
            raise over("the number of stop_token_ids", len(body.stop_token_ids), self.max_stop_token_ids,
                       "--max-stop-token-ids")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: plain text, some JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(_Strict):
    """vLLM's extra field `structured_outputs` (see `minfer.sampling_params.StructuredOutputsParams`)."""

    json_: Optional[Union[str, dict[str, Any]]] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class _Sampling(_Strict):
    """The fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Optional[str] = None
    # vLLM's extra sampling fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None

    def shape(self) -> Optional[StructuredOutputsParams]:
        """The structured output asked for, by response_format or by vLLM's structured_outputs (not both)."""
        wanted = self.response_format if self.response_format is not None and self.response_format.type != "text" else None
        if wanted is not None and self.structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object)
        if wanted is None:
            return None
        if wanted.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if wanted.json_schema is None or wanted.json_schema.schema_ is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema: the JSON schema to follow")
        return StructuredOutputsParams(json=wanted.json_schema.schema_)

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """The engine's SamplingParams; a ValueError (a 400) names any value the engine refuses."""
        try:
            return self._sampling_params(max_tokens, logprobs)
        except TypeError as exc:  # the schema has checked the types: what is left is a value the engine refuses
            raise ValueError(str(exc)) from None

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by minfer: leave it at 0")
        return SamplingParams(n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              min_p=self.min_p or 0.0, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, max_tokens=max_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
                              structured_outputs=self.shape())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's default for completions
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, dict]]:
        """One engine prompt per prompt in the request: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[str, list[dict]]
    name: Optional[str] = None  # the content's text parts are checked and joined by LLM.apply_chat_template


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None  # chat's default: up to the context window
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def token_limit(self) -> Optional[int]:
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ValueError("give max_tokens or max_completion_tokens, not two different values")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, code: int, param: Optional[str] = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(outputs: list[RequestOutput]) -> dict:
    """Token counts: each prompt once (its n completions share it), every completion's tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chosen(entry: dict[int, Logprob]) -> Logprob:
    return next(iter(entry.values()))  # the sampled token comes first (minfer.logprobs)


def completion_logprobs(entries: list[dict[int, Logprob]], start: int = 0, text_offset: int = 0) -> dict:
    """The completions endpoint's logprobs of entries[start:]: the chosen tokens, their logprobs, the top
    alternatives, and where each token starts in the choice's text. text_offset is where entries[start]
    starts (`StreamState` keeps it for a stream, so that a chunk's offsets continue the earlier chunks'
    without a pass over them). (No echoed prompt comes before: echo together with logprobs is refused.)"""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries[start:]:
        chosen = _chosen(entry)
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        top.append({lp.decoded_token: lp.logprob for lp in entry.values()})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(entries: list[dict[int, Logprob]], top_n: int) -> dict:
    """The chat endpoint's logprobs: one {token, logprob, bytes, top_logprobs} per generated token."""
    def item(lp: Logprob) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}

    content = []
    for entry in entries:
        values = list(entry.values())
        alternatives = sorted(values, key=lambda lp: lp.rank)[:top_n]
        content.append({**item(values[0]), "top_logprobs": [item(lp) for lp in alternatives]})
    return {"content": content}


class HoldBack:
    """How much of a growing text to hold back from a stream because it could still become a stop string.

    Text that could be the start of a stop string is cut off if the stop string completes (it
    must never have been streamed), so it waits until the next tokens settle it. That amount is
    the longest proper prefix of a stop string that ends the text. Searching for it afresh costs
    the square of the stop string's length at every chunk; a Knuth-Morris-Pratt automaton per
    stop string, fed only the new characters, costs in proportion to the new text. (The other
    thing that could change, a character whose UTF-8 bytes are split over tokens, never shows:
    the engine's detokenizer holds it back itself, `minfer.detokenizer`.)"""

    def __init__(self, stop: Optional[Union[str, list[str]]]) -> None:
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.fallback = [_prefix_function(s) for s in self.stops]
        self.matched = [0] * len(self.stops)  # per stop string: the longest prefix of it that ends the text
        self.fed = 0  # characters of the text fed so far

    def held(self, text: str) -> int:
        """Characters at the end of `text` (the text so far, grown since the last call) to hold back."""
        new, self.fed = text[self.fed:], len(text)
        longest = 0
        for i, (s, fallback) in enumerate(zip(self.stops, self.fallback)):
            k = self.matched[i]
            for ch in new:
                while k and (k == len(s) or s[k] != ch):
                    k = fallback[k - 1]
                if s[k] == ch:
                    k += 1
            self.matched[i] = k
            longest = max(longest, fallback[k - 1] if k == len(s) else k)  # a proper prefix: shorter than s
        return longest


def _prefix_function(s: str) -> list[int]:
    """pi[i]: the length of the longest proper prefix of s[:i + 1] that is also a suffix of it (KMP's table)."""
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[i] != s[k]:
            k = pi[k - 1]
        pi[i] = k + (s[i] == s[k])
    return pi


class StreamState:
    """What each choice of one stream has been sent so far, so that every chunk carries only what is new.

    A choice is keyed by (prompt index, completion index). `delta` gives the text (and the index
    of the first logprob entry) that an output adds for a choice, or None when it adds nothing
    to send; once a choice's final chunk has gone out, later outputs of its request (which
    still list it) add nothing."""

    def __init__(self, stop: Optional[Union[str, list[str]]]) -> None:
        self.stop = stop
        self._hold_back: dict[tuple[int, int], HoldBack] = {}
        # choice -> (characters, logprob entries) sent, and where the next entry's token starts in the text
        self._sent: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._done: set[tuple[int, int]] = set()

    def first(self, key: tuple[int, int]) -> bool:
        """True the first time a choice shows up (the moment for a role or an echoed prompt)."""
        if key in self._sent:
            return False
        self._sent[key] = (0, 0, 0)
        return True

    def delta(self, key: tuple[int, int], c: CompletionOutput) -> Optional[tuple[str, int, int]]:
        """(new text, index of the first new logprob entry, where that entry's token starts in the text)."""
        if key in self._done:
            return None
        chars, entries, offset = self._sent.get(key, (0, 0, 0))
        finished = c.finish_reason is not None
        hold_back = self._hold_back.setdefault(key, HoldBack(self.stop))
        text = c.text if finished else c.text[:len(c.text) - hold_back.held(c.text)]
        if len(text) <= chars and not finished:
            return None
        new_entries = (c.logprobs or [])[entries:]
        self._sent[key] = (len(text), entries + len(new_entries),
                           offset + sum(len(_chosen(e).decoded_token or "") for e in new_entries))
        if finished:
            self._done.add(key)
        return text[chars:], entries, offset


def finish_fields(c: CompletionOutput) -> dict:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
