"""The sampler's filters against their definitions, on hand-made distributions."""
import torch

from minfer import SamplingParams
from minfer.layers.sampler import filter_logits, sample_next_tokens

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
