"""The simple generation loop of chapters 00-02: static batches over a contiguous KV cache.

A batch is prefilled together (prompts left-padded to the same length), then decoded one token
per step until every row is done. Rows that finish early keep riding along, computing tokens
nobody reads: that waste is what continuous batching removes later in the course.
`use_cache=False` keeps the recompute-everything path for the KV-cache lesson.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

from minfer.kv_cache import KVCache
from minfer.layers.attention import causal_mask
from minfer.layers.sampler import sample_next_tokens
from minfer.logprobs import logprobs_of
from minfer.models.llama import LlamaModel
from minfer.sequence import Sequence


def padded_batch(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad the prompts (token ids): returns input ids, positions and a key-validity mask, all [batch, longest]."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    valid = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        valid[row, longest - len(prompt):] = True
    positions = (valid.cumsum(1) - 1).clamp(min=0)  # every prompt starts at position 0
    return ids.to(device), positions.to(device), valid.to(device)


def attention_mask(valid: torch.Tensor, q_len: int) -> Optional[torch.Tensor]:
    """[batch, 1, q_len, kv_len] mask: causal, and no query looks at padding. None when nothing is padded."""
    if bool(valid.all()):
        return None
    kv_len = valid.shape[1]
    mask = causal_mask(q_len, kv_len, valid.device)[None] & valid[:, None, :]
    # a padding query would see nothing at all (softmax over nothing is NaN): let it see itself
    rows = torch.arange(q_len, device=valid.device)
    mask[:, rows, rows + kv_len - q_len] = True
    return mask[:, None]


def generate_static_batch(model: LlamaModel, tokenizer, seqs: list[Sequence], eos_ids: set[int],
                          use_cache: bool = True) -> Iterator[list[Sequence]]:
    """Generate every sequence of one static batch, yielding the batch after each step."""
    device = model.embed_tokens.weight.device
    ids, positions, valid = padded_batch([s.prompt_token_ids for s in seqs], device)
    steps = max(s.max_tokens for s in seqs)
    cache = KVCache(model.config, len(seqs), ids.shape[1] + steps, model.embed_tokens.weight.dtype, device) if use_cache else None
    scored = [row for row, s in enumerate(seqs) if s.needs_prompt_logits]  # rows that asked for prompt_logprobs
    logits = model(ids, positions, cache, attention_mask(valid, ids.shape[1]), last_only=not scored)
    for row in scored:  # a prompt of n tokens fills the last n columns; the last column predicts the output
        s, longest = seqs[row], ids.shape[1]
        s.prompt_logprobs += logprobs_of(logits[row, longest - len(s.prompt_token_ids):longest - 1],
                                         s.prompt_token_ids[1:], s.params.prompt_logprobs, tokenizer)
    all_ids = ids
    last_position = model.config.max_position_embeddings - 1  # finished rows step on, unread: keep them in RoPE's table
    for _ in range(steps):
        tokens = sample_next_tokens(logits[:, -1], [s.params for s in seqs], [s.seed for s in seqs],
                                    [len(s.output_ids) for s in seqs])
        for row, (s, token) in enumerate(zip(seqs, tokens)):
            if not s.finished:
                if s.logprobs is not None:  # of the raw distribution, before temperature and top-k/p
                    s.add_logprobs(logprobs_of(logits[row, -1:], [token], s.params.logprobs, tokenizer)[0])
                s.append(token, tokenizer, eos_ids)
        yield seqs
        if all(s.finished for s in seqs):
            return
        new_ids = torch.tensor(tokens, device=device)[:, None]
        positions = (positions[:, -1:] + 1).clamp(max=last_position)
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        if use_cache:  # feed only the new token; K/V of the rest come from the cache
            logits = model(new_ids, positions, cache, attention_mask(valid, 1))
        else:  # feed everything again: the O(n^2) way
            all_ids = torch.cat([all_ids, new_ids], dim=1)
            all_positions = (valid.cumsum(1) - 1).clamp(min=0, max=last_position)
            logits = model(all_ids, all_positions, None, attention_mask(valid, all_ids.shape[1]))
