"""Chapter 08: a distilled draft with a small head, and a router: its escalation rule, cost, and threshold.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch08")` in the
notebook.
"""
from __future__ import annotations

import torch


def distillation_loss(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The mean over positions of KL(p || q), as a 0-dim float32 tensor.

    draft_logits, teacher_logits: [..., K] over the same K tokens; p = softmax(teacher_logits),
    q = softmax(draft_logits), both over the last axis. KL(p || q) = sum_i p_i (log p_i - log q_i)
    at each position; average over all the other axes. Work in log space (log_softmax) so that tiny
    probabilities do not turn into log(0).
    """
    raise NotImplementedError("write me")


def head_tokens(token_ids: list[int], vocab_size: int, k: int) -> list[int]:
    """The k most frequent token ids in token_ids, most frequent first.

    Ties (tokens seen equally often, unseen ones included) go to the lower id. Raise ValueError
    unless 1 <= k <= vocab_size.
    """
    raise NotImplementedError("write me")


def scatter_head_logits(head_logits: torch.Tensor, head_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Spread a reduced head's logits [..., K] over the full vocabulary: [..., vocab_size].

    Column head_token_ids[i] receives head_logits[..., i]; every other column is -inf, so that
    softmax gives those tokens probability 0 (the draft can never propose them).
    """
    raise NotImplementedError("write me")


def route(confidence: float, threshold: float) -> str:
    """'cheap' when confidence >= threshold, else 'full'.

    Escalate when in doubt: a confidence that is None or NaN goes to 'full'. Raise ValueError
    unless 0 <= threshold <= 1.
    """
    raise NotImplementedError("write me")


def routing_cost(share_cheap: float, cost_cheap: float) -> float:
    """What a router saves: the mean cost of a request, relative to serving every request with the full model.

    share_cheap: the fraction of requests the router sends to the cheap model, in [0, 1] (the others
    go to the full model); cost_cheap: what one request costs on the cheap model, as a multiple of
    its cost on the full model (>= 0; 0.2 means a fifth). Deciding is free here: the router's own
    cost is left out.
    Returns the mean cost of one request, in units of a full-model request (1.0 saves nothing).
    Raise ValueError unless 0 <= share_cheap <= 1 and cost_cheap >= 0.
    """
    raise NotImplementedError("write me")


def threshold_sweep(confidences: list[float], cheap_correct: list[bool], full_correct: list[bool],
                    thresholds: list[float]) -> list[tuple[float, float]]:
    """For each threshold, in the order given: (share of requests routed cheap, accuracy served).

    Request i goes cheap when route(confidences[i], threshold) == 'cheap' (so a NaN confidence
    escalates); the answer served is then right when cheap_correct[i], else when full_correct[i].
    Accuracy is the share of all requests whose served answer is right. Compute each share as a count
    divided by len(confidences): the notebook compares your floats exactly with minfer's. Raise
    ValueError unless the three lists are non-empty and of the same length.
    """
    raise NotImplementedError("write me")


def cheapest_threshold(confidences: list[float], cheap_correct: list[bool], full_correct: list[bool],
                       target_accuracy: float) -> float | None:
    """The lowest threshold that still serves at least target_accuracy, or None.

    The candidates are 0.0 and every distinct (non-NaN) confidence: no other threshold changes the
    routing. A lower threshold routes more requests cheap, so the lowest candidate that meets the
    target is the cheapest. Return None when none does, or when no candidate routes any request cheap
    (every confidence NaN): then escalate everything. Raise ValueError unless 0 <= target_accuracy <= 1.
    """
    raise NotImplementedError("write me")
