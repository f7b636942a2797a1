"""A router: easy requests to a cheap model, hard ones to the full model (chapter 08).

The arithmetic of routing (as in FrugalGPT, Chen et al. 2023, arXiv:2305.05176, and RouteLLM,
Ong et al. 2024, arXiv:2406.18665): if a share s of requests is served by a model whose cost is c
relative to the full model's 1, a request costs on average

    cost = s * c + (1 - s) * 1

instead of 1. That assumes the decision is free. Here it is not: the classifier is the cheap
model's own confidence in its answer, so every request first runs the cheap model, and an
escalated one pays the full model on top: c + (1 - s) (`routing_cost(..., include_classifier=True)`).
Routing then saves only when s > c.

Quality is correctness: each request of the labelled set (`minfer.lab.router_tasks`) has a checker,
and a routed answer is right when the answer actually served passes it. A cheap answer worded
differently from the full model's is not penalised, and a cheap answer that is right where the
full model is wrong counts as right.

Confidence signals (`SIGNALS`), all in [0, 1], read off the cheap model's greedy answer:
    min_prob      the lowest top-token probability over the answer (an answer is as sure as its weakest step)
    mean_prob     the geometric mean of the top-token probabilities: exp(mean log-probability)
    first_margin  top-1 minus top-2 probability at the first answer token
Below a threshold, or when the signal is unusable (no answer, NaN), the request escalates.
`separation_auc` measures how well a signal separates right cheap answers from wrong ones.
Measuring cheap candidates against the full model (c, sweeps, the operating point) is a harness:
`minfer.lab.bench.router`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from minfer.generate import attention_mask, padded_batch
from minfer.kv_cache import KVCache
from minfer.models.llama import LlamaModel

SIGNALS = ("min_prob", "mean_prob", "first_margin")


@dataclass
class Answer:
    token_ids: list[int]
    top_probs: list[float]  # the model's probability of each token it chose
    second_probs: list[float]  # the probability of the runner-up at each step

    @property
    def min_prob(self) -> float:
        return min(self.top_probs) if self.top_probs else float("nan")

    @property
    def mean_prob(self) -> float:
        if not self.top_probs:
            return float("nan")
        return math.exp(sum(math.log(max(p, 1e-30)) for p in self.top_probs) / len(self.top_probs))

    @property
    def first_margin(self) -> float:
        return self.top_probs[0] - self.second_probs[0] if self.top_probs else float("nan")

    def confidence(self, signal: str = "min_prob") -> float:
        if signal not in SIGNALS:
            raise ValueError(f"signal must be one of {SIGNALS}, got {signal!r}")
        return getattr(self, signal)


def greedy_answer(model: LlamaModel, prompt_ids: list[int], max_tokens: int,
                  stop_token_ids: Sequence[int] = ()) -> Answer:
    """One prompt's greedy answer: `greedy_answers` at batch 1."""
    return greedy_answers(model, [prompt_ids], max_tokens, stop_token_ids)[0]


@torch.inference_mode()
def greedy_answers(model: LlamaModel, prompts: list[list[int]], max_tokens: int,
                   stop_token_ids: Sequence[int] = ()) -> list[Answer]:
    """Greedy decoding of a static batch over a contiguous KV cache, recording each step's top two probabilities.

    The loop of chapter 02 (`minfer.generate`): prompts left-padded to the longest, each starting at
    position 0; a row that is done rides along until every row is. The tokens every prompt starts
    with (a chat template's system turn) are computed once and their keys and values copied into
    every row, as a prefix cache would share them (chapter 05). Each row stops after max_tokens
    or after a token of stop_token_ids (which is kept in the answer). A draft with a reduced head
    (`head_token_ids`) answers in target token ids."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not prompts or not all(prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token id lists")
    window = model.config.max_position_embeddings
    if max(map(len, prompts)) + max_tokens - 1 > window:
        raise ValueError(f"the longest prompt ({max(map(len, prompts))} tokens) and max_tokens {max_tokens} do not fit "
                         f"the model's {window} positions: shorten it or ask for fewer tokens")
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    head = getattr(model, "head_token_ids", None)
    shared = shared_prefix_length(prompts) if len(prompts) > 1 else 0
    ids, positions, valid = padded_batch([p[shared:] for p in prompts], device)  # each row's own tokens
    cache = KVCache(model.config, len(prompts), shared + ids.shape[1] + max_tokens, dtype, device)
    if shared:
        prefix = KVCache(model.config, 1, shared, dtype, device)
        model(torch.tensor([prompts[0][:shared]], device=device), torch.arange(shared, device=device)[None], prefix)
        cache.k[:, :, :, :shared], cache.v[:, :, :, :shared] = prefix.k, prefix.v  # (broadcast over the rows)
        cache.advance(shared)
        positions = positions + shared
        valid = torch.cat([torch.ones(len(prompts), shared, dtype=torch.bool, device=device), valid], dim=1)
    logits = model(ids, positions, cache, attention_mask(valid, ids.shape[1]))
    answers = [Answer([], [], []) for _ in prompts]
    running = list(range(len(prompts)))
    for step in range(max_tokens):
        best = torch.softmax(logits[:, -1].float(), dim=-1).topk(2)
        chosen = best.indices[:, 0] if head is None else head[best.indices[:, 0]]
        tokens, top, second = chosen.tolist(), best.values[:, 0].tolist(), best.values[:, 1].tolist()
        for row in running:
            answers[row].token_ids.append(tokens[row])
            answers[row].top_probs.append(top[row])
            answers[row].second_probs.append(second[row])
        running = [row for row in running if tokens[row] not in stop_token_ids]
        if not running or step == max_tokens - 1:
            break
        positions = positions[:, -1:] + 1
        valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        logits = model(chosen.to(device)[:, None], positions, cache, attention_mask(valid, 1))
    return answers


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """How many tokens every prompt starts with, leaving each prompt at least its last token to compute."""
    longest_possible = min(len(p) for p in prompts) - 1
    for i in range(longest_possible):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return max(longest_possible, 0)


def route(confidence: Optional[float], threshold: float) -> str:
    """'cheap' only when the cheap model is sure enough; 'full' below the threshold or when in doubt."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    if confidence is None or math.isnan(confidence) or confidence < threshold:
        return "full"
    return "cheap"


def routing_cost(share_cheap: float, cost_cheap: float, include_classifier: bool = False) -> float:
    """Mean cost per request relative to always using the full model: share_cheap x cost_cheap + share_full x 1.

    With include_classifier, every request pays for the cheap model's attempt and escalated ones
    pay the full model on top: cost_cheap + share_full."""
    if not 0.0 <= share_cheap <= 1.0:
        raise ValueError(f"share_cheap must be in [0, 1], got {share_cheap!r}")
    if cost_cheap < 0:
        raise ValueError(f"cost_cheap must be >= 0, got {cost_cheap!r}")
    share_full = 1.0 - share_cheap
    if include_classifier:
        return cost_cheap + share_full
    return share_cheap * cost_cheap + share_full


@dataclass
class RoutingResult:
    threshold: float
    share_cheap: float
    accuracy: float  # share of all requests whose served answer is right
    misrouted: int  # routed cheap, answered wrong, though the full model was right: quality lost silently
    wasted_escalations: int  # escalated although the cheap answer was right: cost paid for nothing
    cost: float  # s * c + (1 - s)
    cost_with_classifier: float  # c + (1 - s): every request pays the cheap attempt


def _check_lengths(confidences: Sequence[float], cheap_correct: Sequence[bool], full_correct: Sequence[bool]) -> None:
    if not confidences or not len(confidences) == len(cheap_correct) == len(full_correct):
        raise ValueError("confidences, cheap_correct and full_correct must be non-empty and of the same length, got "
                         f"{len(confidences)}, {len(cheap_correct)}, {len(full_correct)}")


def evaluate_routing(confidences: Sequence[float], cheap_correct: Sequence[bool], full_correct: Sequence[bool],
                     threshold: float, cost_cheap: float) -> RoutingResult:
    """Score one threshold on a labelled set: per request, the cheap model's confidence and whether
    the cheap and the full model's answers are right."""
    _check_lengths(confidences, cheap_correct, full_correct)
    cheap = [route(c, threshold) == "cheap" for c in confidences]
    right = [cc if go_cheap else fc for go_cheap, cc, fc in zip(cheap, cheap_correct, full_correct)]
    share = sum(cheap) / len(cheap)
    return RoutingResult(
        threshold, share, sum(right) / len(right),
        misrouted=sum(go and not cc and fc for go, cc, fc in zip(cheap, cheap_correct, full_correct)),
        wasted_escalations=sum(not go and cc for go, cc in zip(cheap, cheap_correct)),
        cost=routing_cost(share, cost_cheap), cost_with_classifier=routing_cost(share, cost_cheap, True))


def candidate_thresholds(confidences: Sequence[float]) -> list[float]:
    """Every threshold that changes the routing: 0 and each distinct confidence, ascending."""
    return sorted({0.0} | {float(c) for c in confidences if c is not None and not math.isnan(c)})


def threshold_sweep(confidences: Sequence[float], cheap_correct: Sequence[bool], full_correct: Sequence[bool],
                    cost_cheap: float, thresholds: Optional[Sequence[float]] = None) -> list[RoutingResult]:
    """evaluate_routing at each threshold (default: `candidate_thresholds`), in the order given."""
    thresholds = candidate_thresholds(confidences) if thresholds is None else thresholds
    return [evaluate_routing(confidences, cheap_correct, full_correct, t, cost_cheap) for t in thresholds]


def cheapest_threshold(confidences: Sequence[float], cheap_correct: Sequence[bool], full_correct: Sequence[bool],
                       target_accuracy: float) -> Optional[float]:
    """The lowest candidate threshold (the most requests served cheap, so the lowest cost) whose
    accuracy is at least target_accuracy; None when no threshold that routes anything cheap meets it."""
    if not 0.0 <= target_accuracy <= 1.0:
        raise ValueError(f"target_accuracy must be in [0, 1], got {target_accuracy!r}")
    for t in candidate_thresholds(confidences):
        result = evaluate_routing(confidences, cheap_correct, full_correct, t, 0.0)
        if result.share_cheap > 0 and result.accuracy >= target_accuracy:  # 0 only when every confidence is NaN
            return t
    return None


def separation_auc(confidences: Sequence[float], correct: Sequence[bool]) -> float:
    """The chance that a right answer is more confident than a wrong one (ties count half): the
    area under the ROC curve. 0.5 means the signal does not separate; 1.0 separates perfectly."""
    right = [c for c, ok in zip(confidences, correct) if ok]
    wrong = [c for c, ok in zip(confidences, correct) if not ok]
    if len(confidences) != len(correct) or not right or not wrong:
        raise ValueError("separation_auc needs confidences and correct of the same length, with at least one right "
                         f"and one wrong answer (got {len(right)} right, {len(wrong)} wrong)")
    wins = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    return wins / (len(right) * len(wrong))


class Router:
    """Answer with the cheap model when it is confident, else escalate to the full model."""

    def __init__(self, cheap: LlamaModel, full: LlamaModel, threshold: float, signal: str = "min_prob",
                 max_tokens: int = 16, stop_token_ids: Sequence[int] = ()) -> None:
        route(0.0, threshold)  # validates the threshold
        Answer([], [], []).confidence(signal)  # validates the signal
        self.cheap, self.full, self.threshold, self.signal = cheap, full, threshold, signal
        self.max_tokens, self.stop_token_ids = max_tokens, tuple(stop_token_ids)

    def answer(self, prompt_ids: list[int]) -> tuple[str, Answer]:
        """('cheap' | 'full', the answer served)."""
        attempt = greedy_answer(self.cheap, prompt_ids, self.max_tokens, self.stop_token_ids)
        if route(attempt.confidence(self.signal), self.threshold) == "cheap":
            return "cheap", attempt
        return "full", greedy_answer(self.full, prompt_ids, self.max_tokens, self.stop_token_ids)
