"""The router: the escalation rule, the cost formula, scoring a threshold, greedy answers with confidence."""
import math

import pytest
import torch

from minfer.bench.spec import cost_ratio
from minfer.router import Answer, Router, evaluate_routing, greedy_answer, route, routing_cost, routing_prompts
from minfer.spec.distill import init_draft_from_target
from minfer.testing import tiny_llama


def test_route_escalates_when_unsure():
    assert route(0.9, 0.5) == "cheap"
    assert route(0.5, 0.5) == "cheap"
    assert route(0.49, 0.5) == "full"
    assert route(float("nan"), 0.0) == "full"  # no usable signal: in doubt, escalate
    assert route(0.0, 0.0) == "cheap"
    with pytest.raises(ValueError, match="threshold"):
        route(0.5, 1.5)


def test_routing_cost_formula():
    assert routing_cost(0.7, 0.1) == pytest.approx(0.37)  # the seeds' worked example
    assert routing_cost(0.7, 0.1, include_classifier=True) == pytest.approx(0.4)
    assert routing_cost(0.0, 0.1) == 1.0 and routing_cost(1.0, 0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="share_cheap"):
        routing_cost(1.2, 0.1)
    with pytest.raises(ValueError, match="cost_cheap"):
        routing_cost(0.5, -1)


def test_evaluate_routing_by_hand():
    confidences = [0.9, 0.8, 0.3, 0.95, 0.1]
    agrees = [True, False, False, True, True]
    r = evaluate_routing(confidences, agrees, 0.5, cost_cheap=0.2)
    # cheap: 0.9 (agrees), 0.8 (does not), 0.95 (agrees); full: 0.3, 0.1 (always right)
    assert r.share_cheap == pytest.approx(3 / 5)
    assert r.quality_kept_cheap == pytest.approx(2 / 3)
    assert r.quality_kept == pytest.approx(4 / 5)
    assert r.cost == pytest.approx(0.6 * 0.2 + 0.4)
    assert r.cost_with_classifier == pytest.approx(0.2 + 0.4)
    strict = evaluate_routing(confidences, agrees, 1.0, 0.2)
    assert strict.share_cheap == 0 and strict.quality_kept == 1.0 and math.isnan(strict.quality_kept_cheap)
    with pytest.raises(ValueError, match="same length"):
        evaluate_routing([0.5], [True, False], 0.5, 0.2)


def test_greedy_answer_matches_recomputing_everything():
    model = tiny_llama()
    prompt = [3, 14, 15, 9, 2]
    answer = greedy_answer(model, prompt, 6)
    ids, probs = list(prompt), []
    for _ in range(6):  # the O(n^2) way, no cache
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
        probs.append(torch.softmax(logits, -1).max().item())
        ids.append(int(logits.argmax()))
    assert answer.token_ids == ids[len(prompt):]
    assert answer.top_probs == pytest.approx(probs, abs=1e-5)
    assert answer.confidence == pytest.approx(min(probs), abs=1e-5)
    assert math.isnan(Answer([], []).confidence)


def test_a_reduced_head_answers_in_target_token_ids():
    target = tiny_llama()
    head = torch.tensor([7, 21, 40, 63])
    draft = init_draft_from_target(target, [0], 24, head)
    answer = greedy_answer(draft, [1, 2, 3], 5)
    assert set(answer.token_ids) <= set(head.tolist())


def test_router_thresholds_at_the_extremes():
    full = tiny_llama(0)
    cheap = tiny_llama(1)
    prompt = [5, 6, 7]
    assert Router(cheap, full, threshold=0.0).answer(prompt) == ("cheap", greedy_answer(cheap, prompt, 8))
    assert Router(cheap, full, threshold=1.0).answer(prompt) == ("full", greedy_answer(full, prompt, 8))
    with pytest.raises(ValueError, match="threshold"):
        Router(cheap, full, threshold=-0.1)


def test_cost_ratio_of_a_model_with_itself_is_about_one():
    model = tiny_llama()
    assert 1 / 3 < cost_ratio(model, model, context_len=8, repeats=3) < 3


def test_routing_prompts_are_labelled_and_reproducible(llm):
    prompts = routing_prompts(llm.tokenizer, per_kind=10, seed=3)
    assert [k for k, _ in prompts].count("easy") == 10 and [k for k, _ in prompts].count("hard") == 10
    assert prompts == routing_prompts(llm.tokenizer, per_kind=10, seed=3)
    assert all(len(ids) > 3 for _, ids in prompts)
