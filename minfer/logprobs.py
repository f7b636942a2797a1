"""Log-probabilities: how sure the model was of each token, as vLLM returns them.

The model's last layer gives logits, one score per vocabulary token. log_softmax turns a row of
logits into log-probabilities: logprob(t) = logit(t) - log(sum over all tokens of exp(logit)).
Summed over a text, -logprob is its negative log-likelihood, and exp(mean NLL) is the perplexity
(`minfer.lab.evaluate`): the number every quantization step is measured against.

What a request gets back (vLLM's shape): for each position, a dict {token id: Logprob} holding the
token actually there (sampled, or read from the prompt) first, then the num_top most likely
tokens in order. rank counts the tokens with a higher logprob, plus one (the most likely is 1).

These are the *raw* logprobs of the model's distribution, before temperature, top-k, top-p or
min-p reshape it for sampling: vLLM's default (its logprobs_mode "raw_logprobs"). So they mean the
same whatever the request's sampling settings, and a sampled token may well have rank > 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

MAX_LOGPROBS = 20  # the most top tokens a request may ask for (vLLM's default max_logprobs)


@dataclass
class Logprob:
    """One token's entry: its log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


def logprobs_of(logits: torch.Tensor, token_ids: list[int], num_top: int, tokenizer) -> list[dict[int, Logprob]]:
    """logits [rows, vocab] and the token at each row -> one {token id: Logprob} dict per row.

    Each dict holds token_ids[row] first, then the num_top most likely tokens (one entry fewer
    when the token is among them).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # competition ranking: ties share the better rank
    top = logprobs.topk(min(num_top, logprobs.shape[1]), dim=1) if num_top else None
    rows = []
    for row, token in enumerate(token_ids):
        entries = [(token, float(chosen[row, 0]), int(ranks[row]))]
        if top is not None:
            values, indices = top.values[row].tolist(), top.indices[row].tolist()
            # ranks of the top tokens, tie-aware like the chosen token's: equal values share a rank
            entries += [(t, v, 1 + sum(u > v for u in values)) for t, v in zip(indices, values) if t != token]
        texts = tokenizer.batch_decode([[t] for t, _, _ in entries])
        rows.append({t: Logprob(v, r, text) for (t, v, r), text in zip(entries, texts)})
    return rows
