"""The fixed texts minfer measures and calibrates on: slices of the Python documentation that ships
inside every CPython (`pydoc_data.topics`; no download), chosen by topic name.

    eval_tokens(tokenizer)            the evaluation text (perplexity, `minfer.lab.evaluate`)
    calibration_token_ids(tokenizer)  the calibration text (AWQ, GPTQ, carved experts, fp8 KV scales)

The two sets of topics are disjoint, so nothing is ever fitted to the text it is judged on. The
text can change between CPython versions: compare numbers made with the same Python
(`minfer.lab.evaluate.eval_set_info`). Everything here is plain Python on a tokenizer: it imports
nothing of minfer, so the quantizers, the engine and the course's evaluation can all share it.
"""
from __future__ import annotations

from typing import Sequence

EVAL_TOPICS = ("execmodel", "exceptions", "import", "try", "with", "function", "class")
NUM_TOKENS = 4096  # the evaluation text's length in tokens, by default
CALIBRATION_TOPICS = ("specialnames", "typesseq", "formatstrings", "compound", "string-methods", "typesmapping")
CALIBRATION_TOKENS = 2048


def eval_text(topics: Sequence[str] = EVAL_TOPICS) -> str:
    """The evaluation text: the chosen pydoc topics, in order, separated by blank lines."""
    from pydoc_data.topics import topics as pydoc_topics

    missing = [t for t in topics if t not in pydoc_topics]
    if missing:
        raise ValueError(f"pydoc topics {missing} are not in this Python's pydoc_data.topics")
    return "\n\n".join(pydoc_topics[t].strip() for t in topics)


def eval_tokens(tokenizer, num_tokens: int = NUM_TOKENS, topics: Sequence[str] = EVAL_TOPICS) -> list[int]:
    """The first num_tokens tokens of the evaluation text."""
    ids = tokenizer.encode(eval_text(topics), add_special_tokens=False)
    if not isinstance(num_tokens, int) or not 2 <= num_tokens <= len(ids):
        raise ValueError(f"num_tokens must be an integer in [2, {len(ids)}] (the text's length), got {num_tokens!r}")
    return ids[:num_tokens]


def calibration_token_ids(tokenizer, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    """The first num_tokens tokens of the calibration text (pydoc topics not in the evaluation set)."""
    ids = tokenizer.encode(eval_text(CALIBRATION_TOPICS), add_special_tokens=False)
    if not isinstance(num_tokens, int) or not 1 <= num_tokens <= len(ids):
        raise ValueError(f"num_tokens must be an integer in [1, {len(ids)}], got {num_tokens!r}")
    return ids[:num_tokens]
