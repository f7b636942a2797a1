"""transformers' `generate` timed as minfer is timed, for the comparison in the generate benchmark.

Same token ids, greedy, EOS switched off so both engines generate the same number of tokens; TTFT and
TPOT from the time each generate step's logits were ready (`minfer.lab.bench.common.StepClock`).
"""
from __future__ import annotations

import time
import warnings
from typing import Optional, Sequence, Union

import torch

from minfer.lab.bench.common import StepClock, dtype_name, synchronize
from minfer.lab.bench.decode_speed import TokenIds, as_token_ids, batch_of
from minfer.lab.bench.timing import Timing


def time_transformers(hf_model, tokenizer, prompts: Sequence[Union[str, TokenIds]], max_tokens: int = 32,
                      batch_size: Optional[int] = None, warmup: bool = True) -> Timing:
    """Greedy-decode exactly `max_tokens` tokens for `batch_size` prompts with transformers' `generate`.

    A logits processor notes the time of every step, so TTFT and TPOT come from one call, defined
    as minfer defines them. EOS is switched off for the call, so both engines generate the same
    number of tokens. Prompts of different lengths are left-padded.
    """
    from transformers import LogitsProcessorList

    if max_tokens < 2:
        raise ValueError("max_tokens must be >= 2: TPOT needs a token after the first")
    batch = batch_of([as_token_ids(p, tokenizer) for p in prompts], batch_size)
    device = next(hf_model.parameters()).device
    longest = max(len(ids) for ids in batch)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (longest - len(ids)) + ids for ids in batch], device=device)
    attention = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in batch], device=device)
    config = hf_model.generation_config
    saved = config.eos_token_id, config.pad_token_id
    config.eos_token_id, config.pad_token_id = None, pad
    kwargs = dict(attention_mask=attention, do_sample=False, temperature=None, top_p=None, top_k=None)
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            if warmup:
                hf_model.generate(input_ids, max_new_tokens=2, min_new_tokens=2, **kwargs)
            clock = StepClock()
            synchronize(device)
            start = time.perf_counter()
            out = hf_model.generate(input_ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                    logits_processor=LogitsProcessorList([clock]), **kwargs)
    finally:
        config.eos_token_id, config.pad_token_id = saved
    generated = out.shape[1] - longest
    if generated != max_tokens or len(clock.times) != max_tokens:
        raise RuntimeError(f"transformers generated {generated} tokens ({len(clock.times)} steps), expected {max_tokens}")
    ttft = clock.times[0] - start
    tpot = (clock.times[-1] - clock.times[0]) / (max_tokens - 1)
    return Timing("transformers", dtype_name(hf_model.dtype), len(batch), ttft, tpot, max_tokens, longest,
                  extra={"token_ids": out[:, longest:].tolist()})

