"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults)."""
from __future__ import annotations

import copy
import enum
import math
import warnings
from dataclasses import dataclass
from typing import Optional, Union

from minfer.logprobs import MAX_LOGPROBS

# Below this a temperature divides the logits into infinities, and the softmax into NaN; vLLM raises
# such temperatures to the same floor (with a warning) instead of failing.
MIN_TEMPERATURE = 0.01
MAX_N = 4096  # completions per prompt (a server may allow fewer: `minfer serve --max-n`)


class RequestOutputKind(enum.Enum):
    """When a request reports its output (vLLM's enum). CUMULATIVE: after every step that gave it a token,
    everything so far. FINAL_ONLY: once, when it finishes; `LLM.generate` asks for this, and the engine then
    builds no output and, without stop strings, decodes no text until the end (a few microseconds per
    sequence per step). vLLM's DELTA (only what is new since the last output) is not implemented."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(kw_only=True)
class StructuredOutputsParams:
    """What shape the output must take (vLLM's `StructuredOutputsParams`; give exactly one):

    json: a JSON schema (a dict or its JSON text): the output is a JSON value valid against it.
    regex: the output matches this regular expression, whole.
    choice: the output is one of these strings.
    grammar: the output is a sentence of this EBNF grammar (GBNF, as llama.cpp writes it; the rule `root` starts).
    json_object: True: the output is some JSON object.
    Each is compiled once (and cached) into a mask over the vocabulary, applied at every step
    (see `minfer.engine.structured_output`)."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, regex, choice, grammar or json_object; got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or a string), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"structured_outputs.{name} must be a string, got {type(getattr(self, name)).__name__}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple))
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise TypeError(f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs.json_object must be True or False, got {self.json_object!r}")


@dataclass(kw_only=True)  # keywords only, as in vLLM (whose fields come in another order)
class SamplingParams:
    """The subset of vLLM's `SamplingParams` that minfer implements, with the same meanings.

    n: completions per prompt. temperature: 0 means greedy. top_p: keep the smallest set of
    tokens whose probability adds up to top_p. top_k: keep the k most likely (0 or -1: all).
    min_p: drop tokens below min_p x the top probability. seed: a private random stream for
    this request (all 64 bits count), so its samples do not depend on what else is in the batch (with speculative
    decoding: while the scheduler keeps the request's drafts; when the others' load makes it cut them, to fit the
    step's token budget or the free blocks, the tokens keep the model's distribution but may differ). stop: strings that
    end the output (not included unless include_stop_str_in_output). stop_token_ids: extra
    tokens that end it (a stopping token, like end-of-sequence, is in token_ids but not in the
    text unless include_stop_str_in_output). ignore_eos: keep going past the end-of-sequence token.
    max_tokens: the most tokens to generate. logprobs: for each generated token, also return its
    log-probability and those of the `logprobs` most likely tokens (0: the sampled token only;
    None: nothing). prompt_logprobs: the same for every prompt token (see `minfer.logprobs`).
    structured_outputs: a shape the output must take (JSON schema, regex, choice, grammar; see
    `StructuredOutputsParams`). output_kind: when the engine reports the request's output
    (`RequestOutputKind`: after every step, or only once it finishes).
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
    structured_outputs: Optional[StructuredOutputsParams] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        def bad(what: str, value, allowed: str) -> ValueError:
            return ValueError(f"{what} must be {allowed}, got {value!r}")

        # types first, strictly (as OpenAI's API and vLLM's): True is not 1, "2" is not 2
        for name, kind in (("n", int), ("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                           ("seed", int), ("max_tokens", int), ("logprobs", int), ("prompt_logprobs", int),
                           ("ignore_eos", bool), ("include_stop_str_in_output", bool), ("skip_special_tokens", bool)):
            value = getattr(self, name)
            if value is None and name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
                continue
            if not _has_type(value, kind):
                allowed = {int: "an integer", float: "a number", bool: "True or False"}[kind]
                raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
        if not 1 <= self.n <= MAX_N:  # each completion is a sequence made up front: a bound keeps memory finite
            raise bad("n", self.n, f"an integer >= 1 and at most {MAX_N}")
        if not 0 <= self.temperature < math.inf:
            raise bad("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where the softmax turns into "
                          f"infinities and NaN: raised to {MIN_TEMPERATURE} (as vLLM does); use 0 for greedy", stacklevel=3)
            self.temperature = MIN_TEMPERATURE
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", self.top_k, "an integer >= 1, or 0 / -1 to disable")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 (or None: up to the context window)")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise bad("seed", self.seed, "None or an integer in [-2**63, 2**63) (a 64-bit seed)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(name, value, f"None or an integer in [0, {MAX_LOGPROBS}] (0: only the chosen token)")
        if not (self.stop is None or isinstance(self.stop, (str, list, tuple))) \
                or any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop", self.stop, "a non-empty string or a list of them")
        if self.stop_token_ids is not None and (
                not isinstance(self.stop_token_ids, (list, tuple))
                or any(not _has_type(t, int) or t < 0 for t in self.stop_token_ids)):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)")
        if self.output_kind not in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            raise ValueError(f"output_kind must be RequestOutputKind.CUMULATIVE (every step, all so far) or "
                             f"RequestOutputKind.FINAL_ONLY (once, at the end); got {self.output_kind!r}"
                             + (" (minfer does not implement DELTA)" if self.output_kind is RequestOutputKind.DELTA else ""))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError("structured_outputs must be a StructuredOutputsParams (e.g. StructuredOutputsParams(json=schema)), "
                            f"got {type(self.structured_outputs).__name__}")

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, read when it is used: a `stop` changed after construction counts, as in vLLM."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def text_each_step(self) -> bool:
        """Whether the text must be decoded as the tokens come: for outputs reported every step, and to find
        stop strings. Otherwise it is decoded once, when the sequence ends."""
        return self.output_kind is not RequestOutputKind.FINAL_ONLY or bool(self.stop)

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's name for it)."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _has_type(value, kind: type) -> bool:
    """Strict: a bool is no number, a float no integer; an integer is a number (1 for 1.0)."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else int)
