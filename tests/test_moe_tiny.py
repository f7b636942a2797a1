"""The tiny MoE trainer (minfer.lab.tiny_moe): capacity and the balancing loss by hand, equal active compute,
and a few training steps that lower the loss."""
import pytest
import torch

from minfer.lab.tiny_moe import (TinyConfig, TinyLM, active_params, byte_splits, capacity_mask, expert_capacity, train,
                             load_balancing_loss)


def test_capacity_serves_first_choices_first_and_earlier_tokens_first():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    kept = capacity_mask(ids, 3, capacity=2)
    # expert 0's queue: first choices of tokens 0, 1, 2, then token 3's second choice: the first two fit
    # expert 1's: token 3's first choice, then the second choices of tokens 0 and 2: token 3 and token 0 fit
    assert kept.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    assert expert_capacity(num_tokens=10, top_k=2, num_experts=4, capacity_factor=1.25) == 7


def test_balancing_loss_is_one_when_even_and_e_when_collapsed():
    assert load_balancing_loss(torch.full((8, 4), 0.25), torch.arange(8)[:, None] % 4, 4).item() == pytest.approx(1.0)
    assert load_balancing_loss(torch.eye(4)[[0] * 8], torch.zeros(8, 1, dtype=torch.long), 4).item() == pytest.approx(4.0)


def test_dense_and_top1_moe_have_the_same_active_compute():
    dense, moe = TinyConfig(), TinyConfig(num_experts=8, top_k=1)
    assert active_params(moe) - active_params(dense) == moe.num_layers * moe.dim * 8  # the router only
    assert sum(p.numel() for p in TinyLM(dense).parameters()) < sum(p.numel() for p in TinyLM(moe).parameters()) / 3
    with pytest.raises(ValueError):
        TinyConfig(num_experts=4, top_k=5)


def test_training_lowers_the_loss_and_the_text_avoids_the_evaluation_set():
    from minfer.texts import eval_text

    data = byte_splits()
    assert eval_text()[:400].encode() not in bytes(data["train"].tolist())
    config = TinyConfig(dim=32, num_heads=2, d_ff=32, context=32, num_experts=4, top_k=2, aux_loss_coef=0.01,
                        capacity_factor=1.25)
    run = train(config, data, steps=16, batch_size=8, eval_every=8)
    losses = [point["val_loss"] for point in run["curve"]]
    assert losses[-1] < losses[0] < 5.6  # below the uniform 256-way guess, ln 256 = 5.55
