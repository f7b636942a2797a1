"""The router: the escalation rule, the cost formula, scoring thresholds on correctness, the
confidence signals and their separation, greedy answers against recomputing everything."""
import math

import pytest
import torch

from minfer.lab.bench.spec import cost_ratio
from minfer.lab.router import (Answer, Router, candidate_thresholds, cheapest_threshold, evaluate_routing, greedy_answer,
                           greedy_answers, route, routing_cost, separation_auc, shared_prefix_length,
                           threshold_sweep)
from minfer.speculative.pruned_draft import init_draft_from_target
from minfer.lab.testing import tiny_llama


def test_route_escalates_when_unsure():
    assert route(0.9, 0.5) == "cheap"
    assert route(0.5, 0.5) == "cheap"
    assert route(0.49, 0.5) == "full"
    assert route(float("nan"), 0.0) == "full"  # no usable signal: in doubt, escalate
    assert route(None, 0.0) == "full"
    assert route(0.0, 0.0) == "cheap"
    with pytest.raises(ValueError, match="threshold"):
        route(0.5, 1.5)


def test_routing_cost_formula():
    assert routing_cost(0.7, 0.1) == pytest.approx(0.37)  # FrugalGPT/RouteLLM-style arithmetic: 70 % cheap at c = 0.1
    assert routing_cost(0.7, 0.1, include_classifier=True) == pytest.approx(0.4)
    assert routing_cost(0.0, 0.1) == 1.0 and routing_cost(1.0, 0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="share_cheap"):
        routing_cost(1.2, 0.1)
    with pytest.raises(ValueError, match="cost_cheap"):
        routing_cost(0.5, -1)


CONFIDENCES = [0.9, 0.8, 0.3, 0.95, 0.1]
CHEAP_RIGHT = [True, False, True, True, False]
FULL_RIGHT = [True, True, True, False, True]


def test_evaluate_routing_by_hand():
    r = evaluate_routing(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.5, cost_cheap=0.2)
    # cheap: 0.9 (right), 0.8 (wrong, full was right: misrouted), 0.95 (right, though full is wrong);
    # full: 0.3 (right; the cheap answer was right too: a wasted escalation), 0.1 (right)
    assert r.share_cheap == pytest.approx(3 / 5)
    assert r.accuracy == pytest.approx(4 / 5)
    assert r.misrouted == 1 and r.wasted_escalations == 1
    assert r.cost == pytest.approx(0.6 * 0.2 + 0.4)
    assert r.cost_with_classifier == pytest.approx(0.2 + 0.4)
    everything_full = evaluate_routing(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 1.0, 0.2)
    assert everything_full.share_cheap == 0 and everything_full.accuracy == pytest.approx(4 / 5)
    everything_cheap = evaluate_routing(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.0, 0.2)
    assert everything_cheap.share_cheap == 1 and everything_cheap.accuracy == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="same length"):
        evaluate_routing([0.5], [True, False], [True], 0.5, 0.2)


def test_sweep_and_the_cheapest_threshold_for_a_target():
    assert candidate_thresholds(CONFIDENCES + [0.8, float("nan")]) == [0.0, 0.1, 0.3, 0.8, 0.9, 0.95]
    sweep = threshold_sweep(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.2)
    assert [r.threshold for r in sweep] == [0.0, 0.1, 0.3, 0.8, 0.9, 0.95]
    assert [r.share_cheap for r in sweep] == pytest.approx([1.0, 1.0, 0.8, 0.6, 0.4, 0.2])
    # served right: t=0 or 0.1: cheap everywhere, 3/5; t=0.3: the 0.1 one escalates (full right): 4/5;
    # t=0.8: the 0.3 one escalates too (right either way): 4/5; t=0.9: the wrong 0.8 one escalates: 5/5
    assert [r.accuracy for r in sweep] == pytest.approx([0.6, 0.6, 0.8, 0.8, 1.0, 1.0])
    assert cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.8) == 0.3
    assert cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 1.0) == 0.9
    assert cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.5) == 0.0
    assert cheapest_threshold([0.5, 0.6], [False, False], [True, True], 0.9) is None
    assert cheapest_threshold([float("nan")] * 2, [True, True], [True, True], 0.5) is None  # 0.0 would route none
    with pytest.raises(ValueError, match="target_accuracy"):
        cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 1.5)


def test_separation_auc():
    assert separation_auc([0.9, 0.8, 0.2, 0.1], [True, True, False, False]) == 1.0
    assert separation_auc([0.1, 0.2, 0.8, 0.9], [True, True, False, False]) == 0.0
    assert separation_auc([0.5, 0.5], [True, False]) == 0.5  # a tie counts half
    # 3 right x 2 wrong pairs: 0.9 beats both, 0.3 beats 0.1 only, 0.2 beats 0.1 only -> 4 of 6
    assert separation_auc([0.9, 0.3, 0.2, 0.5, 0.1], [True, True, True, False, False]) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="at least one right and one wrong"):
        separation_auc([0.5, 0.6], [True, True])


def test_confidence_signals_by_hand():
    answer = Answer([4, 7, 2], [0.5, 0.8, 0.25], [0.3, 0.1, 0.2])
    assert answer.confidence("min_prob") == 0.25
    assert answer.confidence("mean_prob") == pytest.approx((0.5 * 0.8 * 0.25) ** (1 / 3))
    assert answer.confidence("first_margin") == pytest.approx(0.2)
    assert all(math.isnan(Answer([], [], []).confidence(s)) for s in ("min_prob", "mean_prob", "first_margin"))
    with pytest.raises(ValueError, match="signal"):
        answer.confidence("entropy")


def test_greedy_answer_matches_recomputing_everything():
    model = tiny_llama()
    prompt = [3, 14, 15, 9, 2]
    answer = greedy_answer(model, prompt, 6)
    ids, top, second = list(prompt), [], []
    for _ in range(6):  # the O(n^2) way, no cache
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
        probs = torch.softmax(logits, -1).topk(2).values
        top.append(probs[0].item())
        second.append(probs[1].item())
        ids.append(int(logits.argmax()))
    assert answer.token_ids == ids[len(prompt):]
    assert answer.top_probs == pytest.approx(top, abs=1e-5)
    assert answer.second_probs == pytest.approx(second, abs=1e-5)
    assert answer.min_prob == pytest.approx(min(top), abs=1e-5)
    stop = answer.token_ids[2]
    first = answer.token_ids.index(stop)
    stopped = greedy_answer(model, prompt, 6, stop_token_ids=[stop])
    assert stopped.token_ids == answer.token_ids[:first + 1]  # the stop token is kept, nothing after it
    with pytest.raises(ValueError, match="max_tokens"):
        greedy_answer(model, prompt, 0)


def test_a_reduced_head_answers_in_target_token_ids():
    target = tiny_llama()
    head = torch.tensor([7, 21, 40, 63])
    draft = init_draft_from_target(target, [0], 24, head)
    answer = greedy_answer(draft, [1, 2, 3], 5)
    assert set(answer.token_ids) <= set(head.tolist())


def test_a_batch_answers_as_each_prompt_alone():
    """Left padding, per-row stops and a reduced head: every row equals its batch-1 answer."""
    target = tiny_llama()
    draft = init_draft_from_target(target, [0], 24, torch.tensor([7, 21, 40, 63, 5]))
    prompts = [[3, 14, 15, 9, 2], [8], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41]]
    for model in (target, draft):
        alone = [greedy_answer(model, p, 7) for p in prompts]
        stop = [alone[0].token_ids[1], alone[2].token_ids[0]]  # row 0 stops at its second token, row 2 at once
        for stop_ids in ([], stop):
            alone = [greedy_answer(model, p, 7, stop_ids) for p in prompts]
            batched = greedy_answers(model, prompts, 7, stop_ids)
            assert [a.token_ids for a in batched] == [a.token_ids for a in alone]
            for b, a in zip(batched, alone):
                assert b.top_probs == pytest.approx(a.top_probs, abs=1e-5)
                assert b.second_probs == pytest.approx(a.second_probs, abs=1e-5)
        assert len(batched[2].token_ids) == 1 and len(batched[0].token_ids) <= 2
    system = [11, 12, 13, 14, 15, 16]  # a shared start, as a chat template's system turn: computed once
    shared = [system + p for p in prompts] + [system[:4]]
    assert shared_prefix_length(shared) == 3  # the shortest prompt keeps its last token
    assert shared_prefix_length(shared[:-1]) == 6 and shared_prefix_length([[1, 2], [3, 2]]) == 0
    alone = [greedy_answer(target, p, 7) for p in shared]
    batched = greedy_answers(target, shared, 7)
    assert [a.token_ids for a in batched] == [a.token_ids for a in alone]
    for b, a in zip(batched, alone):
        assert b.top_probs == pytest.approx(a.top_probs, abs=1e-5)
    for bad in ([], [[1, 2], []]):
        with pytest.raises(ValueError, match="prompts"):
            greedy_answers(target, bad, 4)
    window = target.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"do not fit the model's {window} positions"):
        greedy_answers(target, [[1] * (window - 2), [5]], 4)
    assert len(greedy_answers(target, [[1] * (window - 3), [5]], 4)[0].token_ids) <= 4  # the last position, exactly


def test_router_thresholds_at_the_extremes():
    full = tiny_llama(0)
    cheap = tiny_llama(1)
    prompt = [5, 6, 7]
    assert Router(cheap, full, threshold=0.0).answer(prompt) == ("cheap", greedy_answer(cheap, prompt, 16))
    assert Router(cheap, full, threshold=1.0).answer(prompt) == ("full", greedy_answer(full, prompt, 16))
    with pytest.raises(ValueError, match="threshold"):
        Router(cheap, full, threshold=-0.1)
    with pytest.raises(ValueError, match="signal"):
        Router(cheap, full, threshold=0.5, signal="loudness")


def test_cost_ratio_of_a_model_with_itself_is_about_one():
    model = tiny_llama()
    assert 1 / 3 < cost_ratio(model, model, context_len=8, repeats=3) < 3
