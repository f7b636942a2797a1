"""A labelled set of checkable tasks for the router (chapter 08), made in code: no download.

Each `Task` is a short chat question with a checker: an answer is right when it contains the
expected result as a whole number or word (so "3 + 5 = 8" and "The answer is 8." both count for
8, while 18 or 80 do not). Quality is correctness: a cheap answer worded differently from the
full model's is right as long as it gets the result.

The kinds grow in difficulty for a 135M-parameter model: addition of 1 to 4 digits, products of
growing size, copying a list of words, writing a word in capitals, and facts (capitals of
countries, the day or month after another, opposites) that a small instruction-tuned model is
likely to have seen many times. Which ones the full model actually gets right is measured, not
assumed (`benchmarks/bench_router.py`, notebook 08).
"""
from __future__ import annotations

import random
import time
import re
from dataclasses import dataclass

from minfer.lab.router import SIGNALS, greedy_answers

MATCH_KINDS = ("number", "word", "word_exact_case")


@dataclass(frozen=True)
class Task:
    kind: str  # e.g. "add 3-digit"; groups tasks of one difficulty
    question: str  # the user's message (the chat template is applied by `task_prompt_ids`)
    expected: str  # what a right answer must contain
    match: str  # "number", "word" (any case) or "word_exact_case"

    def __post_init__(self) -> None:
        if self.match not in MATCH_KINDS:
            raise ValueError(f"match must be one of {MATCH_KINDS}, got {self.match!r}")

    def check(self, answer: str) -> bool:
        """Is `answer` right? The expected result must appear in it as a whole number or word."""
        if self.match == "number":
            text = re.sub(r"(?<=\d)[,\s](?=\d{3}\b)", "", answer)  # 1,234 and 1 234 read as 1234
            return re.search(rf"(?<![\d.]){re.escape(self.expected)}(?!\d|\.\d)", text) is not None
        flags = 0 if self.match == "word_exact_case" else re.IGNORECASE
        return re.search(rf"(?<!\w){re.escape(self.expected)}(?!\w)", answer, flags) is not None


COUNTRY_CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
                    ("Japan", "Tokyo"), ("England", "London"), ("Russia", "Moscow"), ("China", "Beijing"),
                    ("Egypt", "Cairo"), ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
                    ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Canada", "Ottawa"), ("Poland", "Warsaw"),
                    ("Sweden", "Stockholm"), ("Thailand", "Bangkok"), ("Kenya", "Nairobi"), ("Peru", "Lima")]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("fast", "slow"),
             ("happy", "sad"), ("open", "closed"), ("light", "dark"), ("old", "new"), ("left", "right")]
WORDS = ["apple", "river", "stone", "cloud", "green", "table", "music", "light", "garden", "window", "paper",
         "silver", "forest", "candle", "bridge", "orange"]


def make_tasks(per_kind: int = 10, seed: int = 0) -> list[Task]:
    """per_kind tasks of each of 12 kinds (the fact kinds stop at the facts listed), reproducible by seed."""
    if per_kind < 1:
        raise ValueError(f"per_kind must be >= 1, got {per_kind}")
    rng = random.Random(seed)
    number = lambda lo, hi: rng.randint(lo, hi)
    tasks: list[Task] = []

    def arithmetic(kind: str, sign: str, digits_a: int, digits_b: int) -> None:
        for _ in range(per_kind):
            a = number(10 ** (digits_a - 1) if digits_a > 1 else 1, 10 ** digits_a - 1)
            b = number(10 ** (digits_b - 1) if digits_b > 1 else 1, 10 ** digits_b - 1)
            result = a + b if sign == "+" else a * b
            tasks.append(Task(kind, f"What is {a} {sign} {b}? Answer with the number only.", str(result), "number"))

    arithmetic("add 1-digit", "+", 1, 1)
    arithmetic("add 2-digit", "+", 2, 2)
    arithmetic("add 3-digit", "+", 3, 3)
    arithmetic("add 4-digit", "+", 4, 4)
    arithmetic("multiply 1x1", "*", 1, 1)
    arithmetic("multiply 2x2", "*", 2, 2)
    for _ in range(per_kind):
        words = rng.sample(WORDS, 3)
        # a copy is right when it holds the words in order; the checker looks for the whole phrase
        tasks.append(Task("copy 3 words", f"Repeat exactly, and nothing else: {' '.join(words)}", " ".join(words),
                          "word"))
    for _ in range(per_kind):
        word = rng.choice(WORDS)
        tasks.append(Task("capitals", f"Write the word '{word}' in capital letters.", word.upper(),
                          "word_exact_case"))
    for country, capital in rng.sample(COUNTRY_CAPITALS, min(per_kind, len(COUNTRY_CAPITALS))):
        tasks.append(Task("capital city", f"What is the capital of {country}?", capital, "word"))
    for i in rng.sample(range(len(DAYS)), min(per_kind, len(DAYS))):
        tasks.append(Task("next day", f"Which day of the week comes after {DAYS[i]}?", DAYS[(i + 1) % 7], "word"))
    for i in rng.sample(range(len(MONTHS)), min(per_kind, len(MONTHS))):
        tasks.append(Task("next month", f"Which month comes after {MONTHS[i]}?", MONTHS[(i + 1) % 12], "word"))
    for word, opposite in rng.sample(OPPOSITES, min(per_kind, len(OPPOSITES))):
        tasks.append(Task("opposite", f"What is the opposite of '{word}'? Answer with one word.", opposite, "word"))
    return tasks


def task_prompt_ids(tokenizer, task: Task) -> list[int]:
    """The task as the model's chat template presents it: a user turn, then the assistant's turn to answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": task.question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)  # the template writes its own special tokens


def answer_tasks(model, tokenizer, tasks: list[Task], max_tokens: int = 16, batch_size: int = 1) -> list[dict]:
    """Answer each task greedily with `model` (stopping at end of turn) and grade it.

    One row per task: kind, the answer text, whether it is right, the confidence signals of
    `minfer.lab.router.SIGNALS` and the generated token count. At batch_size 1 each row also has the
    seconds its answer took (what `RouterStudy.timed_cost` adds up); a batch's time belongs to no
    single task, so batched rows have seconds None. The answers are the same either way."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rows = []
    for first in range(0, len(tasks), batch_size):
        batch = tasks[first:first + batch_size]
        start = time.perf_counter()
        answers = greedy_answers(model, [task_prompt_ids(tokenizer, t) for t in batch], max_tokens, stop)
        seconds = time.perf_counter() - start if batch_size == 1 else None
        for task, answer in zip(batch, answers):
            text = tokenizer.decode(answer.token_ids, skip_special_tokens=True)
            rows.append({"kind": task.kind, "question": task.question, "expected": task.expected, "answer": text,
                         "correct": task.check(text), "num_tokens": len(answer.token_ids), "seconds": seconds,
                         **{signal: answer.confidence(signal) for signal in SIGNALS}})
    return rows
