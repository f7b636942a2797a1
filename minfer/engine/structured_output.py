"""Structured outputs: make the model write JSON of a schema, a regex, one of some choices, or a grammar.

The model is never asked to obey. At every step, before sampling, every token that would break the
shape gets the logit -inf, so the sampler cannot pick it; whatever it picks among the rest keeps
the output on the path to a valid end. Which tokens are allowed depends on the text so far, so
each sequence carries a matcher: an automaton over the grammar that advances with each token.

    shape ──compile once (cached)──> grammar ──> one matcher per sequence
    each step:  matchers ──fill──> bitmask [rows, vocab / 32] ──apply──> logits of those rows
    each token: matcher.accept_token(token)

The `xgrammar` library (vLLM's default backend) does the three hard parts: it compiles a JSON
schema, regex or EBNF grammar into a pushdown automaton over the tokenizer's vocabulary,
precomputes which tokens are safe in most states, and fills the masks of a whole batch in one call
on native threads. A choice is compiled as a regex of the alternatives. The end: once the shape is
complete, only an end-of-sequence token is allowed, and the sequence stops.
"""
from __future__ import annotations

import json
import re
from typing import Optional, Sequence

import torch

from minfer.sampling_params import StructuredOutputsParams

try:
    import xgrammar
except ImportError:  # an optional dependency: only requests that ask for a shape need it
    xgrammar = None


def _native_message(exc: Exception) -> str:
    """xgrammar's C++ errors start with a time and a source location: keep only what they say."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


class StructuredOutputs:
    """Compiles shapes for one tokenizer and vocabulary, and masks and advances the matchers of a batch."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None  # made at the first shape: reading the vocabulary takes a fraction of a second
        self._batch = None

    def _compile(self, shape: StructuredOutputsParams):
        if xgrammar is None:
            raise ValueError("structured_outputs needs the xgrammar package: pip install xgrammar")
        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)  # one compile per shape
            self._batch = xgrammar.BatchGrammarMatcher()
        if shape.json is not None:
            schema = shape.json if isinstance(shape.json, str) else json.dumps(shape.json)
            json.loads(schema)  # a JSONDecodeError (a ValueError) names where the text is broken
            return self._compiler.compile_json_schema(schema)
        if shape.json_object:
            return self._compiler.compile_builtin_json_grammar()
        if shape.regex is not None:
            return self._compiler.compile_regex(shape.regex)
        if shape.choice is not None:
            return self._compiler.compile_regex("|".join(f"({re.escape(c)})" for c in shape.choice))
        return self._compiler.compile_grammar(shape.grammar)

    def matchers(self, shape: StructuredOutputsParams, n: int) -> list:
        """n fresh matchers (one per completion) for a shape; a ValueError names what is wrong with it."""
        try:
            grammar = self._compile(shape)
        except (RuntimeError, ValueError) as exc:
            kind = next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(shape, k))
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_native_message(exc)}") from None
        return [xgrammar.GrammarMatcher(grammar) for _ in range(n)]

    def mask(self, logits: torch.Tensor, matchers: Sequence[Optional[object]]) -> None:
        """Set to -inf, in place, every logit that matchers[i] forbids in row i (rows with None: untouched)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = xgrammar.allocate_token_bitmask(len(matchers), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, indices=rows)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=self.vocab_size, indices=rows)
