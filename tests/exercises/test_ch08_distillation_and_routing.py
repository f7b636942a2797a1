"""Chapter 08: the distillation loss, the top-K head, and the router's rule and cost, against minfer's own."""
import math

import pytest
import torch

from minfer.lab import router
from minfer.lab import distill


def test_distillation_loss_matches_minfer_and_a_hand_computed_kl(impl):
    g = torch.Generator().manual_seed(0)
    draft, teacher = torch.randn(3, 5, 11, generator=g), torch.randn(3, 5, 11, generator=g) * 3
    assert impl.distillation_loss(draft, teacher).item() == pytest.approx(
        distill.distillation_loss(draft, teacher).item(), rel=1e-5)
    p, q = torch.softmax(teacher[0, 0], -1), torch.softmax(draft[0, 0], -1)
    by_hand = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    assert impl.distillation_loss(draft[0, 0], teacher[0, 0]).item() == pytest.approx(by_hand, rel=1e-4)


def test_distillation_loss_is_zero_only_for_a_perfect_draft(impl):
    teacher = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    assert impl.distillation_loss(teacher + 5.0, teacher).item() == pytest.approx(0.0, abs=1e-6)  # shift-invariant
    # a uniform draft: KL(p || uniform) = sum p log(7 p), averaged over the 4 positions
    by_hand = sum(pi * math.log(7 * pi) for row in torch.softmax(teacher, -1).tolist() for pi in row) / 4
    assert impl.distillation_loss(torch.zeros(4, 7), teacher).item() == pytest.approx(by_hand, rel=1e-4)
    extreme = torch.tensor([[0.0, -200.0]])  # log space: no log(0)
    assert math.isfinite(impl.distillation_loss(extreme, torch.tensor([[0.0, 0.0]])).item())


def test_head_tokens_by_frequency_ties_to_lower_ids(impl):
    ids = [5, 5, 5, 2, 2, 9, 9, 1]
    assert impl.head_tokens(ids, 10, 3) == [5, 2, 9]
    assert impl.head_tokens(ids, 10, 5) == [5, 2, 9, 1, 0]
    g = torch.Generator().manual_seed(1)
    many = torch.randint(0, 40, (500,), generator=g).tolist()
    expected = distill.select_head_tokens(torch.bincount(torch.tensor(many), minlength=50), 20).tolist()
    assert impl.head_tokens(many, 50, 20) == expected
    with pytest.raises(ValueError):
        impl.head_tokens(ids, 10, 11)


def test_scatter_head_logits(impl):
    head = torch.tensor([4, 0, 7])
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]])
    full = impl.scatter_head_logits(logits, head, 9)
    assert full.shape == (2, 9)
    assert torch.equal(full[:, head], logits)
    others = [i for i in range(9) if i not in head.tolist()]
    assert torch.isinf(full[:, others]).all() and (full[:, others] < 0).all()
    assert torch.softmax(full, -1)[:, others].sum() == 0


def test_route_escalates_when_in_doubt(impl):
    for confidence, threshold in [(0.9, 0.5), (0.5, 0.5), (0.49, 0.5), (0.0, 0.0), (1.0, 1.0), (0.3, 0.8)]:
        assert impl.route(confidence, threshold) == router.route(confidence, threshold)
    assert impl.route(float("nan"), 0.0) == "full"
    assert impl.route(None, 0.5) == "full"
    with pytest.raises(ValueError):
        impl.route(0.5, 1.5)


def test_routing_cost(impl):
    assert impl.routing_cost(0.6, 0.2) == pytest.approx(0.52)  # 48 % cheaper
    for share, cost in [(0.0, 0.2), (1.0, 0.2), (0.35, 0.08)]:
        assert impl.routing_cost(share, cost) == pytest.approx(router.routing_cost(share, cost))
    with pytest.raises(ValueError):
        impl.routing_cost(-0.1, 0.1)
    with pytest.raises(ValueError):
        impl.routing_cost(0.5, -0.1)


CONFIDENCES = [0.9, 0.8, 0.3, 0.95, 0.1, float("nan")]
CHEAP_RIGHT = [True, False, True, True, False, True]
FULL_RIGHT = [True, True, True, False, True, False]


def flat(pairs: list[tuple[float, float]]) -> list[float]:
    return [x for pair in pairs for x in pair]


def test_threshold_sweep_by_hand_and_against_minfer(impl):
    thresholds = [0.0, 0.3, 0.85, 1.0]
    # t=0: all but the NaN one cheap (5/6); right: 0.9, 0.3, 0.95 cheap and the NaN one full (wrong) -> 3/6
    # t=0.3: the 0.1 one escalates (full right) -> 4/6; t=0.85: the wrong 0.8 one escalates too -> 5/6
    # t=1.0: everything full: right except the 0.95 and NaN ones -> 4/6
    assert flat(impl.threshold_sweep(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, thresholds)) == pytest.approx(
        flat([(5 / 6, 3 / 6), (4 / 6, 4 / 6), (2 / 6, 5 / 6), (0.0, 4 / 6)]))
    g = torch.Generator().manual_seed(0)
    confidences = torch.rand(60, generator=g).tolist()
    cheap_right = (torch.rand(60, generator=g) < torch.tensor(confidences)).tolist()  # confident ones tend to be right
    full_right = (torch.rand(60, generator=g) < 0.8).tolist()
    thresholds = [i / 20 for i in range(21)]
    expected = [(r.share_cheap, r.accuracy)
                for r in router.threshold_sweep(confidences, cheap_right, full_right, 0.3, thresholds)]
    assert flat(impl.threshold_sweep(confidences, cheap_right, full_right, thresholds)) == pytest.approx(flat(expected))
    with pytest.raises(ValueError):
        impl.threshold_sweep([0.5], [True, False], [True], [0.5])


def test_cheapest_threshold_for_a_target_accuracy(impl):
    assert impl.cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.5) == 0.0
    assert impl.cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.6) == 0.3  # 4/6 >= 0.6
    assert impl.cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.8) == 0.9  # 0.8 itself routes 0.8 cheap
    assert impl.cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 0.9) is None
    assert impl.cheapest_threshold([float("nan")] * 3, [True] * 3, [True] * 3, 0.5) is None  # nothing can go cheap
    g = torch.Generator().manual_seed(1)
    confidences = torch.rand(40, generator=g).tolist()
    cheap_right = (torch.rand(40, generator=g) < torch.tensor(confidences)).tolist()
    full_right = (torch.rand(40, generator=g) < 0.85).tolist()
    for target in (0.5, 0.7, 0.8, 0.9, 0.95):
        assert impl.cheapest_threshold(confidences, cheap_right, full_right, target) == router.cheapest_threshold(
            confidences, cheap_right, full_right, target)
    with pytest.raises(ValueError):
        impl.cheapest_threshold(CONFIDENCES, CHEAP_RIGHT, FULL_RIGHT, 1.5)
