"""One decode measurement (`Timing`), and the best of repeated ones.

Generation has two phases, timed apart: prefill reads the whole prompt in one forward pass and yields the
first token, its latency is TTFT (time to first token); decode then makes one forward pass per new token,
its latency is TPOT (time per output token, after the first). With `batch` sequences, decode throughput is
batch / TPOT.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence


@dataclass
class Timing:
    """One measurement. Times in seconds; None where it does not apply (the floor has no prefill)."""

    engine: str  # "minfer", "transformers" or "matmul floor"
    dtype: str
    batch_size: int
    ttft_s: Optional[float]
    tpot_s: float
    num_output_tokens: int  # per sequence
    prompt_len: int = 0
    mbu: Optional[float] = None  # model bandwidth utilisation, filled in when the bandwidth is known
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced per second across the batch while decoding: batch / TPOT."""
        return self.batch_size / self.tpot_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


def best_of(timings: Sequence[Timing]) -> Timing:
    """The fastest of repeated measurements: lowest TPOT, and the lowest TTFT on its own.

    Interference from other processes only ever adds time, so the fastest run is the truest one."""
    best = min(timings, key=lambda t: t.tpot_s)
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    best.ttft_s = min(ttfts) if ttfts else None
    return best
