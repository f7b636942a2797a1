"""Chapter 10: routing against the engine's route_topk and by hand, dispatch/combine and the layer against
the engine's reference MoE, the distinct-experts formula against simulation, the load-balancing loss by
hand and against minfer.lab.tiny_moe's, its gradient."""
import math

import pytest
import torch

from minfer.layers.moe import moe_mlp, route_topk
from minfer.lab.tiny_moe import load_balancing_loss


def _logits(tokens=20, experts=8, seed=0):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 3


# ----------------------------------------------------------------- routing

def test_route_top_k_by_hand(impl):
    logits = torch.tensor([[0.0, math.log(3.0), math.log(6.0)]])  # softmax: 0.1, 0.3, 0.6
    w, ids = impl.route_top_k(logits, 2, renormalize=False)
    assert ids.tolist() == [[2, 1]] and ids.dtype == torch.int64
    assert torch.allclose(w, torch.tensor([[0.6, 0.3]]), atol=1e-6) and w.dtype == torch.float32
    w, _ = impl.route_top_k(logits, 2, renormalize=True)
    assert torch.allclose(w, torch.tensor([[2 / 3, 1 / 3]]), atol=1e-6)


@pytest.mark.parametrize("experts,k", [(4, 1), (8, 2), (16, 4), (6, 6)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_top_k_equals_the_engine(impl, experts, k, renormalize):
    logits = _logits(experts=experts, seed=experts + k).to(torch.bfloat16)
    w, ids = impl.route_top_k(logits, k, renormalize)
    w_ref, ids_ref = route_topk(logits, k, renormalize)
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w, w_ref, atol=1e-6)


def test_route_top_k_refuses_bad_k(impl):
    for k in (0, 9):
        with pytest.raises(ValueError):
            impl.route_top_k(_logits(), k, True)
    with pytest.raises(ValueError):
        impl.route_top_k(torch.zeros(8), 1, True)


# ----------------------------------------------------------------- dispatch and combine

def test_dispatch_by_hand(impl):
    ids = torch.tensor([[2, 0], [0, 1], [2, 0]])  # pairs 0..5 choose experts 2, 0, 0, 1, 2, 0
    order, counts = impl.dispatch(ids, 4)
    assert order.tolist() == [1, 2, 5, 3, 0, 4]  # expert 0's pairs, then 1's, then 2's; expert 3 gets none
    assert counts.tolist() == [3, 1, 2, 0]


def test_combine_by_hand(impl):
    ids = torch.tensor([[1, 0], [0, 1]])
    weights = torch.tensor([[0.75, 0.25], [1.0, 0.0]])
    order, _ = impl.dispatch(ids, 2)  # pairs of expert 0: 1, 2; of expert 1: 0, 3
    outputs = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 4.0], [0.0, 8.0]])  # one row per pair, in that order
    out = impl.combine(outputs, order, weights)
    # token 0: 0.75 * (pair 0 = row 2) + 0.25 * (pair 1 = row 0); token 1: 1.0 * (pair 2 = row 1) + 0 * row 3
    assert torch.allclose(out, torch.tensor([[0.25, 3.0], [2.0, 0.0]]))
    assert out.dtype == torch.float32


@pytest.mark.parametrize("experts,k", [(4, 1), (8, 2), (8, 8)])
def test_moe_layer_equals_the_reference(impl, experts, k):
    gen = torch.Generator().manual_seed(k)
    tokens, d, f = 13, 16, 24
    x = torch.randn(tokens, d, generator=gen)
    gate_up = torch.randn(experts, 2 * f, d, generator=gen) / 4
    down = torch.randn(experts, d, f, generator=gen) / 4
    weights, ids = route_topk(torch.randn(tokens, experts, generator=gen) * 3, k, True)
    ours = impl.moe_layer(x, weights, ids, gate_up, down)
    assert torch.allclose(ours, moe_mlp(x, weights, ids, gate_up, down, impl="reference"), atol=1e-5)


# ----------------------------------------------------------------- experts per batch

def test_expected_distinct_experts_by_hand(impl):
    assert impl.expected_distinct_experts(8, 2, 1) == pytest.approx(2.0)  # one token: exactly its k
    assert impl.expected_distinct_experts(8, 8, 5) == pytest.approx(8.0)
    assert impl.expected_distinct_experts(16, 4, 2) == pytest.approx(16 * (1 - 0.75 ** 2))
    assert impl.expected_distinct_experts(16, 4, 0) == 0.0
    assert impl.expected_distinct_experts(64, 2, 512) == pytest.approx(64, abs=1e-5)
    with pytest.raises(ValueError):
        impl.expected_distinct_experts(8, 9, 4)


def test_expected_distinct_experts_matches_simulation(impl):
    gen = torch.Generator().manual_seed(0)
    for experts, k, batch in [(8, 2, 4), (16, 4, 8), (64, 8, 16)]:
        trials = 3000
        picks = torch.rand(trials, batch, experts, generator=gen).topk(k, dim=-1).indices  # k distinct, uniform
        touched = torch.zeros(trials, experts).scatter_(1, picks.flatten(1), 1).sum(1)
        assert impl.expected_distinct_experts(experts, k, batch) == pytest.approx(touched.mean().item(), rel=0.02)


# ----------------------------------------------------------------- the load-balancing loss

def test_load_balancing_loss_by_hand(impl):
    even = torch.full((4, 4), 0.25)
    assert impl.load_balancing_loss(even, torch.tensor([[0], [1], [2], [3]]), 4).item() == pytest.approx(1.0)
    collapsed = torch.tensor([[1.0, 0, 0, 0]] * 4)
    assert impl.load_balancing_loss(collapsed, torch.zeros(4, 1, dtype=torch.long), 4).item() == pytest.approx(4.0)
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]])
    ids = torch.tensor([[0, 1], [2, 0]])  # f = (2, 1, 1) / 4; P = (0.35, 0.35, 0.3)
    assert impl.load_balancing_loss(probs, ids, 3).item() == pytest.approx(3 * (0.5 * 0.35 + 0.25 * 0.35 + 0.25 * 0.3))


def test_load_balancing_loss_equals_the_tiny_trainer_and_has_its_gradient(impl):
    logits = _logits(tokens=32, experts=8, seed=3).requires_grad_()
    probs = logits.softmax(-1)
    _, ids = route_topk(logits.detach(), 2, True)
    ours = impl.load_balancing_loss(probs, ids, 8)
    theirs = load_balancing_loss(probs, ids, 8)
    assert ours.dim() == 0 and ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(ours, logits, retain_graph=True)
    (grad_ref,) = torch.autograd.grad(theirs, logits)
    assert grad.abs().sum() > 0 and torch.allclose(grad, grad_ref, atol=1e-7)
