"""The serving benchmark's workload, and the KV memory each cache layout would reserve for it.

Prompts are slices of real English that needs no download: the Python documentation shipped with
CPython (`pydoc_data.topics`). Output lengths are spread widely and EOS is ignored, so every request
generates exactly what the workload says and every engine does the same work.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def corpus_text() -> str:
    """Real English text that needs no download: the Python documentation topics shipped with CPython."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def text_tokens(tokenizer, num_tokens: int, rng: random.Random, text: Optional[str] = None) -> list[int]:
    """`num_tokens` token ids of a slice of the corpus starting at a random place (deterministic given rng)."""
    text = text or corpus_text()
    width = 8 * num_tokens + 64  # characters: comfortably more than num_tokens tokens of English
    for _ in range(8):
        start = rng.randrange(0, max(1, len(text) - width))
        ids = tokenizer.encode(text[start:start + width], add_special_tokens=False)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
        width *= 2
    raise ValueError(f"could not cut {num_tokens} tokens out of the corpus")


def make_workload(tokenizer, num_requests: int = 128, prompt_len: tuple[int, int] = (32, 384),
                  output_len: tuple[int, int] = (16, 512), seed: int = 0, output_dist: str = "loguniform") -> list[Request]:
    """Requests with lengths in the given inclusive ranges (fixed seed): prompt lengths uniform, output
    lengths log-uniform (as many between 16 and 64 as between 128 and 512: many short answers, a long
    tail, as in chat traffic) or uniform."""
    if num_requests < 1 or not 1 <= prompt_len[0] <= prompt_len[1] or not 1 <= output_len[0] <= output_len[1]:
        raise ValueError(f"bad workload: {num_requests} requests, prompt_len {prompt_len}, output_len {output_len}")
    if output_dist not in ("loguniform", "uniform"):
        raise ValueError(f"output_dist must be 'loguniform' or 'uniform', got {output_dist!r}")
    rng, text = random.Random(seed), corpus_text()
    lo, hi = output_len
    requests = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_len)
        if output_dist == "uniform":
            olen = rng.randint(lo, hi)
        else:
            olen = min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))
        requests.append(Request(text_tokens(tokenizer, plen, rng, text), olen))
    return requests


def kv_waste(prompt_lens: Sequence[int], output_lens: Sequence[int], bytes_per_token: int, block_size: int = 16,
             batch_size: int = 32, max_model_len: Optional[int] = None) -> list[dict]:
    """Reserved vs used KV bytes of every request at its largest (the end of its generation), summed.

    used: prompt + output tokens. Schemes:
      * contiguous, max_model_len: every sequence reserves the whole context window up front;
      * contiguous, static batches: batches of batch_size in order, each row reserving
        (longest prompt + longest output of its batch) slots, as `minfer.generate` allocates;
      * paged: whole blocks, so at most one partly filled block per sequence.
    waste = 1 - used / reserved.
    """
    lengths = [p + o for p, o in zip(prompt_lens, output_lens)]
    used = sum(lengths) * bytes_per_token
    schemes = []
    if max_model_len:
        schemes.append(("contiguous, max_model_len per sequence", len(lengths) * max_model_len))
    static = 0
    for start in range(0, len(lengths), batch_size):
        ps, os_ = prompt_lens[start:start + batch_size], output_lens[start:start + batch_size]
        static += len(ps) * (max(ps) + max(os_))
    schemes.append((f"contiguous, static batches of {batch_size}", static))
    schemes.append((f"paged, blocks of {block_size}", sum(-(-n // block_size) * block_size for n in lengths)))
    return [{"scheme": name, "reserved_bytes": slots * bytes_per_token, "used_bytes": used,
             "waste": 1 - used / (slots * bytes_per_token)} for name, slots in schemes]
