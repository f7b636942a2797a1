"""Chapter 12: counting operations, the host-time arithmetic, and a batched sampler checked for exactness and for
an operation count that does not grow with the batch."""
import math

import pytest
import torch

from minfer.lab.bench.host import OpCounter
from minfer.layers.sampler import draw, filter_logits


def test_count_aten_ops_counts_what_runs(impl):
    x = torch.randn(4, 4)
    assert impl.count_aten_ops(lambda: x + 1) == 1
    assert impl.count_aten_ops(lambda: (x @ x).relu().sum()) == 3
    assert impl.count_aten_ops(lambda: None) == 0
    results = []
    impl.count_aten_ops(lambda: results.append(x * 2))  # the operations still run, and return their results
    assert torch.equal(results[0], x * 2)


def test_count_aten_ops_agrees_with_the_engines_counter(impl):
    logits = torch.randn(8, 50)

    def work():
        return torch.softmax(logits / 0.7, dim=-1).cumsum(dim=-1).argmax(dim=-1)
    with OpCounter() as ops:
        work()
    assert impl.count_aten_ops(work) == ops.count


def test_step_time_adds_without_overlap_and_takes_the_slower_with_it(impl):
    # a 1 ms device step, 0.3 ms of fixed host work and 20 µs per sequence
    assert impl.step_time_ms(1.0, 0.3, 20.0, 1) == pytest.approx(1.32)
    assert impl.step_time_ms(1.0, 0.3, 20.0, 256) == pytest.approx(1.0 + 0.3 + 5.12)
    assert impl.step_time_ms(1.0, 0.3, 20.0, 1, overlap=True) == pytest.approx(1.0)  # the device sets the pace
    assert impl.step_time_ms(1.0, 0.3, 20.0, 256, overlap=True) == pytest.approx(5.42)  # the host does


def test_host_budget(impl):
    assert impl.host_budget_us(1.0, 0.2, 256) == pytest.approx(800 / 256)
    assert impl.host_budget_us(18.0, 2.0, 32) == pytest.approx(500.0)
    assert impl.host_budget_us(0.5, 0.8, 8) == 0.0
    # at the budget, overlap hides the host exactly
    per_seq = impl.host_budget_us(2.0, 0.5, 64)
    assert impl.step_time_ms(2.0, 0.5, per_seq, 64, overlap=True) == pytest.approx(2.0)


def settings(rows: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.tensor([[0.0, 0.7, 1.0, 1.3][i % 4] for i in range(rows)])
    top_k = torch.tensor([[0, 5, 0, int(torch.randint(1, vocab, (1,), generator=gen))][i % 4] for i in range(rows)])
    top_p = torch.tensor([[1.0, 1.0, 0.8, 0.6][(i // 2) % 4] for i in range(rows)])
    return temperature, top_k, top_p


def engine_token(row: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The engine's sampler on one row: minfer.layers.sampler's filters, then its draw at u."""
    if temperature == 0:
        return int(row.argmax())
    probs = torch.softmax(filter_logits(row, temperature, top_k, top_p), dim=-1)
    return int(draw(probs[None], torch.tensor([u]))[0])


def test_batched_sample_matches_the_engine_row_by_row(impl):
    rows, vocab = 64, 200
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 2
    temperature, top_k, top_p = settings(rows, vocab)
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(2))
    tokens = impl.batched_sample(logits, temperature, top_k, top_p, uniforms)
    assert tokens.shape == (rows,) and tokens.dtype == torch.long
    expected = [engine_token(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), float(uniforms[i]))
                for i in range(rows)]
    assert tokens.tolist() == expected


def test_batched_sample_follows_the_filtered_distribution(impl):
    """Exact: 6000 draws of one row's settings against the distribution they define (total variation within noise)."""
    n, vocab = 6000, 10
    logits = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 1.5).expand(n, -1)
    for temperature, top_k, top_p in ((0.9, 0, 1.0), (1.2, 4, 1.0), (1.0, 0, 0.7)):
        target = torch.softmax(filter_logits(logits[0], temperature, top_k, top_p), dim=-1)
        tokens = impl.batched_sample(logits, torch.full((n,), temperature), torch.full((n,), top_k),
                                     torch.full((n,), top_p), torch.rand(n, generator=torch.Generator().manual_seed(4)))
        freq = torch.bincount(tokens, minlength=vocab).float() / n
        noise = sum(math.sqrt(float(p) * (1 - float(p)) / (2 * math.pi * n)) for p in target)
        assert 0.5 * float((freq - target).abs().sum()) < 3 * noise + 1e-9, (temperature, top_k, top_p)
        assert float(freq[target == 0].sum()) == 0  # never a filtered token


def test_batched_sample_keeps_the_top_token_for_a_tiny_top_p(impl):
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 0.0, 0.0]])
    tokens = impl.batched_sample(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1e-30, 1e-30]),
                                 torch.tensor([0.99, 0.5]))
    assert tokens.tolist() == [1, 0]


def test_batched_sample_dispatches_the_same_operations_at_any_batch_size(impl):
    counts = {}
    for rows in (4, 256):
        logits = torch.randn(rows, 100)
        temperature, top_k, top_p = settings(rows, 100)
        with OpCounter() as ops:
            impl.batched_sample(logits, temperature, top_k, top_p, torch.rand(rows))
        counts[rows] = ops.count
    assert counts[256] == counts[4], counts
