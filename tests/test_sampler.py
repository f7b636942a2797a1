"""The sampler's filters against their definitions, on hand-made distributions; the draw itself."""
import torch

from minfer import SamplingParams
from minfer.bench.common import best_time
from minfer.layers.sampler import filter_logits, sample_from, sample_next_tokens

PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
LOGITS = PROBS.log()


def kept(logits):
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_k_keeps_the_k_most_likely():
    assert kept(filter_logits(LOGITS, 1.0, top_k=2, top_p=1.0)) == [0, 1]
    assert kept(filter_logits(LOGITS, 1.0, top_k=0, top_p=1.0)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert kept(filter_logits(LOGITS, 1.0, top_k=0, top_p=0.5)) == [0]
    assert kept(filter_logits(LOGITS, 1.0, top_k=0, top_p=0.6)) == [0, 1]
    assert kept(filter_logits(LOGITS, 1.0, top_k=0, top_p=0.85)) == [0, 1, 2]
    shuffled = LOGITS[[3, 0, 4, 2, 1]]  # order in the vocabulary must not matter
    assert kept(filter_logits(shuffled, 1.0, top_k=0, top_p=0.6)) == [1, 4]


def test_min_p_and_temperature():
    assert kept(filter_logits(LOGITS, 1.0, top_k=0, top_p=1.0, min_p=0.3)) == [0, 1, 2]
    assert torch.allclose(filter_logits(LOGITS, 2.0, 0, 1.0), LOGITS / 2)


def test_min_p_comes_before_top_p_as_in_vllm():
    # min_p 0.3 drops 0.1 (below 0.3 x 0.4); renormalised, the first two hold 0.78 >= 0.75, so top_p keeps two.
    # Top-p first would keep three (0.4 + 0.3 < 0.75) and min-p would then drop none of them.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert kept(filter_logits(logits, 1.0, top_k=0, top_p=0.75, min_p=0.3)) == [0, 1]


def test_sampling_follows_the_distribution():
    logits = LOGITS[None].repeat(1, 1)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    counts = torch.bincount(torch.tensor([sample_next_tokens(logits, [params], [gen])[0] for _ in range(4000)]),
                            minlength=5)
    freq = counts.float() / counts.sum()
    assert (freq - PROBS).abs().max() < 0.03  # ~4 standard errors at n=4000


def test_greedy_rows_ignore_the_generator():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    tokens = sample_next_tokens(logits, [SamplingParams(temperature=0)] * 2, [torch.Generator(), None])
    assert tokens == [0, 4]


def test_sample_from_follows_weights_and_never_draws_a_zero():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0]])  # unnormalized, zeros inside and at both ends
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample_from(weights, [gen])[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert freq[[0, 2, 5]].sum() == 0
    assert (freq - weights[0] / weights.sum()).abs().max() < 0.03  # ~4 standard errors at n=4000


def test_sample_from_at_the_ends_of_the_uniform_range(monkeypatch):
    # u = 0 must give the first token with weight, and u * total rounding up to total the last one
    weights = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0]])
    for uniform, expected in ((0.0, 1), (1.0, 2)):
        monkeypatch.setattr(torch, "rand", lambda *args, value=uniform, **kwargs: torch.tensor([value]))
        assert sample_from(weights, [None]) == [expected]


def test_sample_from_draws_each_row_with_its_own_generator():
    probs = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)), dim=-1)
    together = sample_from(probs, [torch.Generator().manual_seed(seed) for seed in range(4)])
    alone = [sample_from(probs[i:i + 1], [torch.Generator().manual_seed(i)])[0] for i in range(4)]
    assert together == alone


def test_sample_from_is_much_cheaper_than_multinomial_on_a_real_vocabulary():
    probs = torch.softmax(torch.randn(1, 49152), dim=-1)  # SmolLM2's vocabulary
    gen = torch.Generator().manual_seed(0)
    ratio = (best_time(lambda: sample_from(probs, [gen]), repeats=20)
             / best_time(lambda: torch.multinomial(probs[0], 1, generator=gen), repeats=20))
    assert ratio < 1 / 3, f"sample_from took {ratio:.2f}x multinomial's time (measured 0.05x)"
