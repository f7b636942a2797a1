"""The router's labelled task set: enough tasks, reproducible, and checkers that accept right answers only."""
import pytest

from minfer.lab.router import SIGNALS
from minfer.lab.router_tasks import Task, answer_tasks, make_tasks, task_prompt_ids


def test_the_set_is_large_reproducible_and_its_answers_are_right():
    tasks = make_tasks(per_kind=10, seed=0)
    assert len(tasks) >= 100
    assert tasks == make_tasks(per_kind=10, seed=0) and tasks != make_tasks(per_kind=10, seed=1)
    assert len({t.kind for t in tasks}) == 12
    for t in tasks:  # the expected result is what the question asks for
        if t.kind.startswith(("add", "multiply")):
            a, sign, b = t.question.removeprefix("What is ").split("?")[0].split()
            assert int(t.expected) == (int(a) + int(b) if sign == "+" else int(a) * int(b))
        assert t.check(t.expected) and t.check(f"The answer is {t.expected}.")
    with pytest.raises(ValueError, match="per_kind"):
        make_tasks(per_kind=0)


def test_number_checker():
    task = Task("add 3-digit", "What is 512 + 722? Answer with the number only.", "1234", "number")
    for right in ["1234", "512 + 722 = 1234", "The answer is 1,234.", "1 234"]:
        assert task.check(right), right
    for wrong in ["12345", "234", "11234", "1234.5", "1233", ""]:
        assert not task.check(wrong), wrong


def test_word_checkers():
    capital = Task("capital city", "What is the capital of France?", "Paris", "word")
    assert capital.check("The capital of France is Paris.") and capital.check("paris")
    assert not capital.check("Parisian cafes") and not capital.check("Lyon")
    shout = Task("capitals", "Write the word 'river' in capital letters.", "RIVER", "word_exact_case")
    assert shout.check("RIVER") and shout.check('"RIVER"')
    assert not shout.check("river") and not shout.check("River") and not shout.check("RIVERS")
    with pytest.raises(ValueError, match="match"):
        Task("x", "q", "a", "fuzzy")


def test_prompts_use_the_chat_template(llm):
    task = make_tasks(1)[0]
    ids = task_prompt_ids(llm.tokenizer, task)
    text = llm.tokenizer.decode(ids)
    assert task.question in text and text.rstrip().endswith("assistant")


def test_batched_answers_grade_as_one_at_a_time(llm):
    """The real model on a dozen tasks of mixed prompt lengths: batches of 5 give batch 1's answers and
    signals; only batch-1 rows carry seconds."""
    tasks = make_tasks(1, seed=3)
    one = answer_tasks(llm.model, llm.tokenizer, tasks, max_tokens=6)
    batched = answer_tasks(llm.model, llm.tokenizer, tasks, max_tokens=6, batch_size=5)
    assert len({len(task_prompt_ids(llm.tokenizer, t)) for t in tasks}) > 3  # the batches are padded
    assert [r["answer"] for r in batched] == [r["answer"] for r in one]
    assert [r["correct"] for r in batched] == [r["correct"] for r in one]
    for b, a in zip(batched, one):
        assert [b[s] for s in SIGNALS] == pytest.approx([a[s] for s in SIGNALS], abs=1e-4)
    assert all(r["seconds"] > 0 for r in one) and all(r["seconds"] is None for r in batched)
    with pytest.raises(ValueError, match="batch_size"):
        answer_tasks(llm.model, llm.tokenizer, tasks, batch_size=0)
