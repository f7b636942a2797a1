"""A router: easy requests to a cheap model, hard ones to the full model (chapter 08).

If a share s of requests can be answered by a model costing c (relative to the full model's 1)
without losing quality, serving costs

    cost = s * c + (1 - s) * 1          (the seeds' formula)

per request instead of 1 (`benchmarks/bench_router.py` measures c as one decode step of each
model at batch 1). Everything rests on the classifier that decides "easy": it must be cheap, and
a hard request sent to the cheap model costs quality, silently. Here the classifier is the cheap
model's own confidence: it answers greedily, and the lowest top-token probability over the first
tokens of its answer is the signal. Below a threshold, or when anything is unclear (no answer,
NaN), the request escalates to the full model. A higher threshold is more conservative: fewer
requests stay cheap, fewer hard ones slip through.

The classifier is not free: every request runs the cheap model first, so an escalated one costs
c + 1. `routing_cost(..., include_classifier=True)` counts that: c + (1 - s).

"Quality kept" is measured against the full model: a routed answer keeps quality when it equals
the full model's greedy answer (the first `max_tokens` tokens).

Any two minfer models can be paired. Chapter 08 uses the int4-quantised target as the cheap model
(`minfer.quant.linear.quantize_model`): the distilled draft predicts the target's next token well
enough for speculative decoding, where each miss is corrected, but its 8-token answers almost
never equal the target's, so as a stand-alone cheap model it would always be escalated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from minfer.kv_cache import KVCache
from minfer.models.llama import LlamaModel


@dataclass
class Answer:
    token_ids: list[int]
    top_probs: list[float]  # the model's probability of each token it chose

    @property
    def confidence(self) -> float:
        """The weakest step: an answer is as trustworthy as its least certain token."""
        return min(self.top_probs) if self.top_probs else float("nan")


@torch.inference_mode()
def greedy_answer(model: LlamaModel, prompt_ids: list[int], max_tokens: int) -> Answer:
    """Greedy decoding at batch 1 over a contiguous KV cache, recording each step's top probability.

    A draft with a reduced head (`head_token_ids`) answers in target token ids."""
    device = model.embed_tokens.weight.device
    head = getattr(model, "head_token_ids", None)
    cache = KVCache(model.config, 1, len(prompt_ids) + max_tokens, model.embed_tokens.weight.dtype, device)
    ids = torch.tensor([prompt_ids], device=device)
    positions = torch.arange(len(prompt_ids), device=device)[None]
    tokens, probs = [], []
    for _ in range(max_tokens):
        p = torch.softmax(model(ids, positions, cache)[0, -1], dim=-1)
        top, index = p.max(dim=-1)
        token = int(head[index]) if head is not None else int(index)
        tokens.append(token)
        probs.append(float(top))
        ids = torch.tensor([[token]], device=device)
        positions = positions[:, -1:] + 1
    return Answer(tokens, probs)


def route(confidence: float, threshold: float) -> str:
    """'cheap' only when the cheap model is sure enough; 'full' below the threshold or when in doubt."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    if confidence is None or math.isnan(confidence) or confidence < threshold:
        return "full"
    return "cheap"


def routing_cost(share_cheap: float, cost_cheap: float, include_classifier: bool = False) -> float:
    """Mean cost per request relative to always using the full model.

    The seeds' formula: share_cheap x cost_cheap + share_full x 1. With include_classifier, every
    request pays for the cheap model's attempt and escalated ones pay the full model on top."""
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
    quality_kept: float  # share of all requests whose served answer equals the full model's
    quality_kept_cheap: float  # the same among those routed cheap (nan when none)
    cost: float  # the seeds' formula
    cost_with_classifier: float


def evaluate_routing(confidences: list[float], agrees: list[bool], threshold: float, cost_cheap: float) -> RoutingResult:
    """Score one threshold on a labelled set: confidences of the cheap model, and whether its answer
    agrees with the full model's (the ground truth for "quality kept" when routed cheap)."""
    if len(confidences) != len(agrees) or not confidences:
        raise ValueError("confidences and agrees must be non-empty lists of the same length")
    cheap = [route(c, threshold) == "cheap" for c in confidences]
    n_cheap = sum(cheap)
    kept_cheap = sum(a for a, c in zip(agrees, cheap) if c)
    share = n_cheap / len(cheap)
    return RoutingResult(threshold, share, (kept_cheap + len(cheap) - n_cheap) / len(cheap),
                         kept_cheap / n_cheap if n_cheap else float("nan"),
                         routing_cost(share, cost_cheap), routing_cost(share, cost_cheap, include_classifier=True))


def routing_prompts(tokenizer, per_kind: int = 16, seed: int = 0) -> list[tuple[str, list[int]]]:
    """A labelled prompt set made in code: ('easy', ids) pattern completions a small model can copy,
    ('hard', ids) arithmetic, word problems and open questions in the chat template. The label says
    what was meant; the ground truth for routing is agreement with the full model, measured."""
    import random

    rng = random.Random(seed)
    easy = ["Monday, Tuesday, Wednesday, Thursday,", "January, February, March, April,",
            "red, orange, yellow, green,", "one, two, three, four, five,", "A, B, C, D, E, F,",
            "The quick brown fox jumps over the", "Twinkle, twinkle, little star, how I wonder",
            "Happy birthday to you, happy birthday to you, happy birthday"]
    while len(easy) < per_kind:
        n, step = rng.randint(1, 90), rng.choice([1, 2, 5, 10])
        words = rng.sample(["apple", "river", "stone", "cloud", "green", "table", "music", "light"], 3)
        easy.append(rng.choice([", ".join(str(n + i * step) for i in range(5)) + ",",
                                " ".join(words * 3) + " " + words[0]]))
    chat = lambda q: tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                   add_generation_prompt=True)
    hard = [chat(q) for q in ["Explain in detail why the sky is blue and sunsets are red.",
                              "Compare Python and Rust for writing an operating system kernel.",
                              "Write a proof that there are infinitely many prime numbers.",
                              "What would happen to the tides if the moon were twice as far away?"]]
    while len(hard) < per_kind:
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 40)
        hard.append(chat(rng.choice([f"What is {a} * {b} + {c}? Show each step.",
                                     f"Tom has {a} apples, buys {b} more and gives {c} away. How many are left?",
                                     f"A train covers {a} km in {c} minutes. What is its speed in km per hour?"])))
    return [("easy", tokenizer(p)["input_ids"]) for p in easy] + [("hard", tokenizer(p)["input_ids"]) for p in hard]


class Router:
    """Answer with the cheap model when it is confident, else escalate to the full model."""

    def __init__(self, cheap: LlamaModel, full: LlamaModel, threshold: float, max_tokens: int = 8) -> None:
        route(0.0, threshold)  # validates the threshold
        self.cheap, self.full, self.threshold, self.max_tokens = cheap, full, threshold, max_tokens

    def answer(self, prompt_ids: list[int], max_tokens: Optional[int] = None) -> tuple[str, Answer]:
        """('cheap' | 'full', the answer served)."""
        n = max_tokens or self.max_tokens
        attempt = greedy_answer(self.cheap, prompt_ids, n)
        if route(attempt.confidence, self.threshold) == "cheap":
            return "cheap", attempt
        return "full", greedy_answer(self.full, prompt_ids, n)
