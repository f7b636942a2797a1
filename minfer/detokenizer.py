"""The text of a growing sequence of tokens, decoding a few tokens per step instead of all of them.

Decoding the whole output again after every token costs time in proportion to its length, so
a sequence of n tokens spends time in proportion to n^2 on its text: at 4,096 tokens that is
1.5 ms a step for each sequence, more than a whole decode step of a small model on a GPU.
Decoding only the newest tokens keeps the cost per token flat. Two things make it less simple
than decoding the new token alone:

- a token's text can depend on the one before it: SentencePiece tokenizers drop the leading
  space of the first token they decode, so the new token is decoded after the last committed
  one, and only the text beyond that one's is new;
- a character's UTF-8 bytes can be split over several tokens (byte-level BPE): until the last
  byte arrives the window decodes to U+FFFD, so nothing is committed until it decodes cleanly.

Both follow the incremental detokenization of vLLM and Hugging Face's TextStreamer. A fast
tokenizer gets the same from the `tokenizers` library's `DecodeStream`, which does this work in Rust.
"""
from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None

REPLACEMENT_CHARACTER = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


class IncrementalDetokenizer:
    """`text` is `tokenizer.decode(token_ids)` of every token appended so far, except that a
    character whose bytes have not all arrived yet is held back; `flush()` gives the full decode."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, every_token: bool = True) -> None:
        """every_token False: only keep the ids, and decode them once, in `flush()` (`text` stays "" until then:
        for a sequence whose text nobody reads before it ends)."""
        self.tokenizer, self.skip_special_tokens, self.every_token = tokenizer, skip_special_tokens, every_token
        # A fast tokenizer whose text transformers returns unchanged is decoded by the `tokenizers`
        # library's own streaming decoder, in Rust: one call of about 1 µs per token, where two
        # calls through transformers take 14 (it converts and checks its arguments on every call)
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = (backend if DecodeStream is not None and backend is not None and hasattr(backend, "decode")
                         and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        self._held = 0  # tokens the stream holds back (an incomplete character)
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0  # the window decoded each step starts here: one committed token of context
        self.read_offset = 0  # tokens before this are in `text`
        self.prefix_text = ""  # the text of token_ids[prefix_offset:read_offset], inside the window

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token: int) -> str:
        """Add one token; returns the text it committed ("" while a character's bytes are incomplete)."""
        self.token_ids.append(token)
        if not self.every_token:
            return ""
        if self._stream is not None:
            new = self._stream.step(self._backend, token)
            if new is None:
                self._held += 1
                return ""
            self._held = 0
            self.text += new
            return new
        window = self._decode(self.token_ids[self.prefix_offset:])
        if window.endswith(REPLACEMENT_CHARACTER):
            return ""  # wait for the character's remaining bytes
        new = window[len(self.prefix_text):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.prefix_text = self._decode(self.token_ids[self.prefix_offset:])
        return new

    def flush(self) -> str:
        """The full decode: `text` with whatever is held back (U+FFFD for bytes that never completed)."""
        if not self.every_token:
            return self._decode(self.token_ids)
        if self._stream is not None:  # what the stream holds back: decoded whole, as it rarely is
            return self.text if not self._held else self._decode(self.token_ids)
        window = self._decode(self.token_ids[self.prefix_offset:])
        return self.text + window[len(self.prefix_text):]
