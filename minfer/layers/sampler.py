"""From logits to the next token: greedy, temperature, top-k, top-p, min-p, per-request seeds,
for every row of the batch in one call.

A decode step samples one token per sequence. Done row by row, each row costs a dozen small
operations (divide, softmax, sort, mask, draw), so a step of 256 sequences dispatches thousands:
on a GPU each is a kernel launch of a few microseconds, and the device waits for the host.
Here every setting is a per-row tensor (`SamplingTensors`), and the whole batch goes through
the same fixed list of operations, whatever its size and mix of settings: greedy rows, sampled
rows, rows with and without top-k or top-p. The draws happen on the logits' device; the one
copy back to the host is the chosen token ids.

The random numbers come from a counter-based generator (`random_uniforms`): row i's uniform is
a hash of (its sequence's seed, the index of the token being drawn). No generator object per
request, no state to advance, one vectorised call for the batch, and still a seeded request
gets the same tokens whatever else shares its batch, and a preempted sequence that is
recomputed draws the same tokens again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from minfer.host_copy import to_device
from minfer.sampling_params import SamplingParams

# SplitMix64's constants (Steele, Lea and Flood, 2014), as signed 64-bit integers: torch's int64
# arithmetic wraps around like C's unsigned arithmetic, which is what the hash needs.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 values: `>>` on a signed tensor copies the sign bit."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser: every output bit depends on every input bit."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def random_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform number in [0, 1) per row: a hash of (seed, counter), int64 tensors of the same shape.

    The same pair always gives the same number, and different pairs give independent-looking
    ones (SplitMix64: the seed is mixed into a key, the counter steps the key's stream). 24 random
    bits: exactly representable in float32, so a token's probability is off by at most 2^-24."""
    key = _mix64(seeds)
    return _shift_right(_mix64(key + (counters + 1) * _GOLDEN), 40).to(torch.float32) * 2.0**-24


def signed_seed(seed: int) -> int:
    """A seed in [0, 2^64) or [-2^63, 2^63) as the int64 it is stored in."""
    seed %= 2**64
    return seed - 2**64 if seed >= 2**63 else seed


@dataclass
class SamplingTensors:
    """The settings of a batch's sampled rows (its greedy rows need none), as tensors on the logits' device.

    rows: which rows of the batch sample (None: all of them). Per sampled row: temperature (> 0),
    top_k (the vocabulary size where off), top_p (1 where off), min_p (0 where off), and the seed
    and counter that choose its random number (`random_uniforms`). any_min_p and candidates are
    what the host knows without reading the tensors back: which filters some row uses, so that a
    batch pays only for those (see `filter_rows`)."""

    rows: Optional[torch.Tensor]  # int64 [sampled rows], or None when every row samples
    temperature: torch.Tensor  # float32 [sampled rows]
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    counters: torch.Tensor  # int64
    any_min_p: bool
    candidates: int  # top-k and top-p look at this many of each row's best tokens (0: no row uses them)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int], vocab_size: int,
              device: torch.device | str = "cpu") -> Optional["SamplingTensors"]:
        """From one SamplingParams, seed and counter per row; None when every row is greedy. A few
        tensors built from Python lists, whatever the batch."""
        rows, settings, randomness, any_min_p, any_filter, widest = [], [], [], False, False, 0
        for row, (p, seed, counter) in enumerate(zip(params, seeds, counters)):
            if p.temperature == 0:
                continue
            top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
            rows.append(row)
            settings.append((p.temperature, top_k, p.top_p, p.min_p))
            randomness.append((seed, counter))
            any_min_p = any_min_p or p.min_p > 0
            any_filter = any_filter or top_k < vocab_size or p.top_p < 1
            widest = max(widest, top_k)  # a row without top-k needs every token ranked
        if not rows:
            return None
        floats = to_device(settings, device, torch.float32)  # top_k < 2^24: exact in float32
        ints = to_device(randomness, device, torch.long)
        return cls(None if len(rows) == len(params) else to_device(rows, device),
                   floats[:, 0], floats[:, 1].long(), floats[:, 2], floats[:, 3], ints[:, 0], ints[:, 1],
                   any_min_p, widest if any_filter else 0)


def filter_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, use_min_p: bool = True, candidates: Optional[int] = None) -> torch.Tensor:
    """Scale each row of logits [rows, vocab] by its temperature and set the tokens it may not pick to -inf.

    In vLLM's order: temperature, min-p, then top-k and top-p (so top-p counts the mass min-p and
    top-k left). Per-row settings as tensors [rows] (temperature > 0; top_k = vocab and top_p = 1
    where off; min_p = 0 where off). What the host knows of the batch saves work without reading a
    device value back: use_min_p, whether any row uses min-p; candidates, how many of each row's
    best tokens top-k and top-p must rank (0: no row uses them; None or the vocabulary: all of
    them, a full sort; fewer when every row has a top-k, then torch.topk ranks only those, a few
    times cheaper than sorting the vocabulary). The most likely token always stays."""
    logits = logits / temperature[:, None]
    if use_min_p:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    vocab = logits.shape[-1]
    candidates = vocab if candidates is None else candidates
    if candidates == 0:
        return logits
    if candidates < vocab:  # the rest are beyond every row's top-k
        ranked, order = torch.topk(logits, candidates, dim=-1)
    else:
        ranked, order = torch.sort(logits, dim=-1, descending=True)
    # each row's k-th best value; tokens tied with it stay
    kth_value = ranked.gather(1, (top_k.clamp(max=candidates) - 1).clamp(min=0)[:, None])
    ranked = ranked.masked_fill(ranked < kth_value, float("-inf"))
    probs = torch.softmax(ranked, dim=-1)
    # drop a token when the tokens ranked above it already cover top_p; top_p = 1 never drops (rounding aside)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p < 1)[:, None]
    drop[:, 0] = False  # the top token stays, even for a top_p too small for float32
    ranked = ranked.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, ranked)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """One row of logits [vocab] through `filter_rows`, with plain numbers for settings (top_k 0 or -1: off)."""
    vocab = logits.shape[-1]
    top_k = top_k if 0 < top_k < vocab else vocab
    settings = to_device([[temperature, top_k, top_p, min_p]], logits.device, torch.float32)  # one copy; top_k exact
    return filter_rows(logits[None].float(), settings[:, 0], settings[:, 1].long(), settings[:, 2], settings[:, 3],
                       use_min_p=min_p > 0, candidates=top_k if top_k < vocab else vocab if top_p < 1 else 0)[0]


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of weights [rows, vocab] (probabilities, or any non-negative weights), row i at uniforms[i].

    Inverse transform sampling: the uniform number, scaled to the row's total, looked up in the
    row's running sum. torch.multinomial costs as much as drawing a random number for every token
    of the vocabulary; this costs a cumulative sum. In float32, a token's probability is off by at
    most half a rounding step of the running sum (3e-8)."""
    cdf = weights.float().cumsum(dim=-1)
    total = cdf[:, -1:].clone()  # contiguous, as searchsorted wants (a copy at any row count)
    tokens = torch.searchsorted(cdf, (uniforms[:, None] * total).contiguous(), right=True)
    # rounding may put u * total at the very end: then the last token with any weight
    return torch.minimum(tokens, torch.searchsorted(cdf, total)).view(-1)


def sample_from(weights: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """`draw` with row i's uniform number from generators[i] (None: the global generator), weights on the CPU."""
    return draw(weights, torch.cat([torch.rand(1, generator=g) for g in generators])).tolist()


def sample(logits: torch.Tensor, settings: Optional[SamplingTensors]) -> torch.Tensor:
    """logits [rows, vocab] -> one token id per row [rows], on the logits' device, each row with its own settings.

    Greedy rows take the argmax; the sampled rows (settings None: none) are filtered
    (`filter_rows`) and drawn (`draw`) at their own random number. The same operations whatever
    the batch holds."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if settings is None:
        return greedy_tokens
    rows = settings.rows
    filtered = filter_rows(logits if rows is None else logits[rows], settings.temperature, settings.top_k,
                           settings.top_p, settings.min_p, settings.any_min_p, settings.candidates)
    drawn = draw(torch.softmax(filtered, dim=-1), random_uniforms(settings.seeds, settings.counters))
    return drawn if rows is None else greedy_tokens.index_put((rows,), drawn)


def sample_next_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                       counters: Sequence[int]) -> list[int]:
    """logits [batch, vocab] -> one token id per row, row i with params[i], drawn at (seeds[i], counters[i]).

    The counter is the index of the token being drawn in its sequence's output, so a seeded
    request gets the same tokens whatever else shares the batch. One copy to the host: the ids."""
    settings = SamplingTensors.build(params, seeds, counters, logits.shape[-1], logits.device)
    return sample(logits, settings).tolist()
