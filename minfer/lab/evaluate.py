"""A fixed evaluation set: did a change (quantization, a new kernel) make the model worse?

Two measures, both computed through the public API (`SamplingParams.prompt_logprobs`), so what
is measured is the engine itself, quantized weights, int8 KV cache and all.

Perplexity. The text is a fixed slice of the Python documentation that ships inside every
CPython (`pydoc_data.topics`; no download; `minfer.texts`): the topics in EVAL_TOPICS, joined by blank lines,
cut to the first NUM_TOKENS tokens. The model reads it in windows of WINDOW tokens that start
every STRIDE tokens; each window scores only the tokens the window before it did not reach, so
every token but the first is scored exactly once, and after the first window each one sees at
least WINDOW - STRIDE tokens of context (4096 tokens: 15 windows of 512, 7680 tokens computed). Perplexity = exp(mean negative log-likelihood per token):
the number of equally likely tokens the model is, on average, choosing between. Lower is
better; what matters here is the relative change against the unquantized model. The text can
change between CPython versions: compare runs made with the same Python (`eval_set_info`).

Greedy agreement. Each prompt of EVAL_PROMPTS is continued greedily for max_tokens tokens by the
reference (the unquantized model). Then both models read the same text, prompt + that
continuation (teacher forcing), and at each continuation position we ask: is the model's most
likely next token the reference's most likely one? The agreement is the share of positions
where it is. Reading the same text keeps one early divergence from poisoning everything after
it (comparing free-running outputs position by position would count every later token as wrong).
A model against itself scores exactly 1.0: the same requests run the same computation.
"""
from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from minfer.sampling_params import SamplingParams
from minfer.texts import EVAL_TOPICS, NUM_TOKENS, eval_tokens

WINDOW = 512
STRIDE = 256

EVAL_PROMPTS = (
    "The Python interpreter reads a program and",
    "def fibonacci(n):\n    ",
    "A list comprehension is a concise way to",
    "import os\nimport sys\n\n\ndef main():\n",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The main difference between a tuple and a list is",
    "To read a file line by line in Python, you can",
    "class Stack:\n    def __init__(self):\n",
    "Water boils at a temperature of",
    "An exception is raised when",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "The three primary colors are",
    "In machine learning, overfitting means that",
    "SELECT name, age FROM users WHERE",
    "The best way to learn a new language is",
)


# --------------------------------------------------------------------------- perplexity

def eval_set_info(tokenizer, num_tokens: int = NUM_TOKENS, window: int = WINDOW, stride: int = STRIDE) -> dict:
    """What a perplexity number was measured on, to store beside it (a hash tells texts apart)."""
    ids = eval_tokens(tokenizer, num_tokens)
    return {"topics": list(EVAL_TOPICS), "num_tokens": num_tokens, "window": window, "stride": stride,
            "python": sys.version.split()[0], "tokens_sha256": hashlib.sha256(str(ids).encode()).hexdigest()[:16]}


def context_windows(num_tokens: int, window: int = WINDOW, stride: int = STRIDE) -> list[tuple[int, int, int]]:
    """(start, end, first scored) per window: the model reads tokens [start, end) and scores
    [first scored, end). Every token but the first is scored exactly once."""
    if not isinstance(window, int) or not isinstance(stride, int) or not 0 < stride <= window or window < 2:
        raise ValueError(f"need integers 0 < stride <= window and window >= 2, got window={window!r}, stride={stride!r}")
    spans, scored, start = [], 1, 0  # the first token has nothing before it to be predicted from
    while scored < num_tokens:
        end = min(start + window, num_tokens)
        spans.append((start, end, scored))
        scored, start = end, start + stride
    return spans


def token_nlls(llm, num_tokens: int = NUM_TOKENS, window: int = WINDOW, stride: int = STRIDE,
               token_ids: Optional[list[int]] = None) -> list[float]:
    """Negative log-likelihood of every scored token (num_tokens - 1 of them), by the engine.

    token_ids: score this text instead of the evaluation set's."""
    ids = token_ids if token_ids is not None else eval_tokens(llm.tokenizer, num_tokens)
    if window >= llm.max_model_len:
        raise ValueError(f"window ({window}) must be smaller than the context window ({llm.max_model_len})")
    spans = context_windows(len(ids), window, stride)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)  # the actual tokens only
    outputs = llm.generate([{"prompt_token_ids": ids[start:end]} for start, end, _ in spans], params, use_tqdm=False)
    nlls = []
    for (start, end, first), out in zip(spans, outputs):
        for i in range(first, end):
            nlls.append(-out.prompt_logprobs[i - start][ids[i]].logprob)
    return nlls


def perplexity(llm, num_tokens: int = NUM_TOKENS, window: int = WINDOW, stride: int = STRIDE,
               token_ids: Optional[list[int]] = None) -> float:
    """exp(mean negative log-likelihood per token) of the evaluation text (see the module docstring)."""
    nlls = token_nlls(llm, num_tokens, window, stride, token_ids)
    return math.exp(sum(nlls) / len(nlls))


# --------------------------------------------------------------------------- greedy agreement

@dataclass
class GreedyReference:
    """What the reference model said, to compare other models against (compute it once)."""

    prompt_token_ids: list[list[int]]
    continuations: list[list[int]]  # its greedy continuations: the text every model reads
    top1: list[list[int]]  # its most likely token at each continuation position, reading that text


def teacher_forced_top1(llm, prompt_token_ids: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """For each prompt + continuation, the model's most likely token at every continuation position."""
    requests = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_token_ids, continuations)]
    outputs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    top1 = []
    for p, c, out in zip(prompt_token_ids, continuations, outputs):
        # prompt_logprobs[i] is the distribution that predicts token i; rank 1 is its argmax
        entries = out.prompt_logprobs[len(p):len(p) + len(c)]
        top1.append([min(e.items(), key=lambda item: item[1].rank)[0] for e in entries])
    return top1


def greedy_reference(llm, prompts: Sequence[str] = EVAL_PROMPTS, max_tokens: int = 32) -> GreedyReference:
    """Greedy continuations of exactly max_tokens tokens (EOS ignored) and their teacher-forced top-1s."""
    outputs = llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    ids = [out.prompt_token_ids for out in outputs]
    continuations = [out.outputs[0].token_ids for out in outputs]
    return GreedyReference(ids, continuations, teacher_forced_top1(llm, ids, continuations))


def greedy_agreement(llm, reference: Union[GreedyReference, object], prompts: Sequence[str] = EVAL_PROMPTS,
                     max_tokens: int = 32) -> float:
    """Share of continuation positions where llm's most likely token equals the reference's.

    reference: a `GreedyReference` (prompts and max_tokens are then ignored) or the reference LLM.
    """
    if not isinstance(reference, GreedyReference):
        reference = greedy_reference(reference, prompts, max_tokens)
    top1 = teacher_forced_top1(llm, reference.prompt_token_ids, reference.continuations)
    pairs = [(a, b) for ours, theirs in zip(top1, reference.top1) for a, b in zip(ours, theirs)]
    if not pairs:
        raise ValueError("the reference has no continuation tokens to compare")
    return sum(a == b for a, b in pairs) / len(pairs)
