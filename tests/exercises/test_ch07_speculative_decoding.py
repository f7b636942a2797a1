"""Chapter 07 checks: the acceptance rule (and that it is lossless), greedy verification, n-gram
lookup, the expected-speedup formula and the estimate of the acceptance alpha it needs."""
import random
from collections import Counter

import pytest
import torch

from minfer.speculative import SpecDecodeStats, ngram_lookup


def one_hot(token: int, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float()


def test_residual_distribution(impl):
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(impl.residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    p, q = torch.tensor([0.4, 0.4, 0.2, 0.0]), torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert torch.allclose(impl.residual_distribution(p, q), torch.tensor([0.6, 0.4, 0.0, 0.0]))
    assert torch.allclose(impl.residual_distribution(p, p), p)  # nothing left over: p itself


def test_verify_drafts_accepts_rejects_and_adds_a_bonus(impl):
    vocab = 5
    p = torch.stack([torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1]), torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0]), one_hot(4, vocab)])
    q = torch.stack([torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]), torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])])
    # both accepted (p >= q for token 1; u = 0.4 < 0.5 / 1.0 for token 3): the bonus comes from p[2], one-hot on 4
    assert impl.verify_drafts([1, 3], q, p, [0.9, 0.4]) == [1, 3, 4]
    # the second rejected (u = 0.6 >= 0.5): resampled from max(0, p - q) = one-hot on token 2
    assert impl.verify_drafts([1, 3], q, p, [0.9, 0.6]) == [1, 2]
    # the first rejected (token 2: p/q = 0.2, u = 0.3): the residual of p[0] - q[0] is on tokens 0, 1, 3, 4
    gen = torch.Generator().manual_seed(0)
    out = impl.verify_drafts([2, 3], q, p, [0.3, 0.0], gen)
    assert len(out) == 1 and out[0] in (0, 1, 3, 4)
    # deterministic guesses (q None = one-hot): accepted when u < p(guess)
    assert impl.verify_drafts([1], None, p[[0, 2]], [0.59]) == [1, 4]
    out = impl.verify_drafts([1], None, p[[0, 2]], [0.61], gen)
    assert len(out) == 1 and out[0] != 1


def test_verify_drafts_is_lossless(impl):
    """The first emitted token follows p exactly, whatever q is; always accepting would give q."""
    p = torch.tensor([0.35, 0.05, 0.25, 0.05, 0.30, 0.00])
    q = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])
    gen = torch.Generator().manual_seed(0)
    n, counts = 8000, Counter()
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        u = float(torch.rand((), generator=gen))
        counts[impl.verify_drafts([x], q[None], torch.stack([p, p]), [u], gen)[0]] += 1
    tv = 0.5 * sum(abs(counts[i] / n - float(p[i])) for i in range(len(p)))
    assert tv < 0.03  # sampling noise is about 0.01 here; q itself is 0.55 away from p


def test_greedy_verify(impl):
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert impl.greedy_verify([1, 0], logits) == [1, 0, 2]  # both agree: the bonus is the argmax of the last row
    assert impl.greedy_verify([1, 2], logits) == [1, 0]  # the second disagrees: replaced by the argmax
    assert impl.greedy_verify([2, 0], logits) == [1]
    assert impl.greedy_verify([], logits[:1]) == [1]


def test_ngram_propose(impl):
    tokens = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert impl.ngram_propose(tokens, 2) == [7, 8]  # the latest earlier match, not the first one
    assert impl.ngram_propose(tokens, 9) == [7, 8, 1, 2, 3]
    assert impl.ngram_propose([4, 5, 6, 1, 4, 5, 6], 3) == [1, 4, 5]
    assert impl.ngram_propose([1, 2, 3, 4], 3) == []
    assert impl.ngram_propose([1, 2, 9, 2], 2, max_n=2, min_n=2) == []
    rng = random.Random(0)
    for _ in range(200):  # agrees with the engine's proposer
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        k, max_n = rng.randint(1, 5), rng.randint(1, 4)
        assert impl.ngram_propose(seq, k, max_n, 1) == ngram_lookup(seq, k, max_n, 1)


def test_expected_speedup(impl):
    # k = 4, alpha = 0.8: 1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.3616 tokens per pass, for 1 + 4 * 0.05 steps
    assert impl.expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert impl.expected_speedup(0.5, 4, 0.05) == pytest.approx(1.9375 / 1.2)
    assert impl.expected_speedup(1.0, 3, 0.1) == pytest.approx(4 / 1.3)
    assert impl.expected_speedup(0.0, 6, 0.2) == pytest.approx(1 / 2.2)  # a useless draft only costs


def test_estimate_alpha(impl):
    # 4 accepted draft tokens; the second and third passes stopped at a rejection, the first ran out
    assert impl.estimate_alpha([3, 3, 2], [3, 1, 0]) == pytest.approx(4 / 6)
    assert impl.estimate_alpha([2, 2], [2, 2]) == 1.0 and impl.estimate_alpha([], []) == 0.0
    rng = random.Random(0)
    for alpha in (0.3, 0.75):  # passes whose draft tokens are accepted independently with a known alpha
        drafted = [rng.randint(1, 5) for _ in range(20000)]
        accepted = []
        for k in drafted:
            kept = 0
            while kept < k and rng.random() < alpha:
                kept += 1
            accepted.append(kept)
        assert impl.estimate_alpha(drafted, accepted) == pytest.approx(alpha, abs=0.02)
        stats = SpecDecodeStats()  # the engine's estimate agrees
        for k, kept in zip(drafted, accepted):
            stats.record(k, kept)
        assert impl.estimate_alpha(drafted, accepted) == pytest.approx(stats.alpha)
        assert stats.draft_acceptance_rate < alpha - 0.05  # vLLM's rate is another quantity
    for drafted, accepted in [([3, 2], [1]), ([3], [4]), ([3], [-1]), ([3], [1.5])]:
        with pytest.raises(ValueError):
            impl.estimate_alpha(drafted, accepted)
