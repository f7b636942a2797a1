"""The sampler's filters against their definitions, on hand-made distributions; the draw itself."""
import torch

from minfer import SamplingParams
from minfer.lab.bench.common import best_time
from minfer.lab.bench.host import OpCounter
from minfer.layers.sampler import (SamplingTensors, filter_logits, filter_rows, random_uniforms, sample_from,
                                   sample_next_tokens)

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
    logits = LOGITS[None]
    params = SamplingParams(temperature=1.0)
    draws = [sample_next_tokens(logits, [params], [0], [i])[0] for i in range(4000)]  # one sequence, 4000 tokens
    freq = torch.bincount(torch.tensor(draws), minlength=5).float() / len(draws)
    assert (freq - PROBS).abs().max() < 0.03  # ~4 standard errors at n=4000


def test_greedy_rows_take_the_argmax():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    assert sample_next_tokens(logits, [SamplingParams(temperature=0)] * 2, [0, 1], [0, 0]) == [0, 4]


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


# ------------------------------------------------------------------ the batched sampler
def splitmix64_reference(seed: int, counter: int) -> float:
    """random_uniforms in plain Python integers: the hash as published, arithmetic modulo 2^64."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)
    key = mix(seed % 2**64)
    return (mix((key + (counter + 1) * 0x9E3779B97F4A7C15) % 2**64) >> 40) / 2**24


def test_random_uniforms_match_the_hash_computed_in_python_integers():
    seeds = [0, 1, 2, -1, 2**63 - 1, -2**63, 123456789123456789]
    counters = [0, 1, 7, 1000, 2**31]
    pairs = [(s, c) for s in seeds for c in counters]
    got = random_uniforms(torch.tensor([s for s, _ in pairs]), torch.tensor([c for _, c in pairs])).tolist()
    assert got == [splitmix64_reference(s, c) for s, c in pairs]


def test_random_uniforms_look_uniform_and_independent_across_seeds_and_counters():
    n = 20000
    by_counter = random_uniforms(torch.zeros(n, dtype=torch.long), torch.arange(n))  # one sequence's stream
    by_seed = random_uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long))  # first draws of consecutive seeds
    for u in (by_counter, by_seed):
        assert 0 <= float(u.min()) and float(u.max()) < 1
        counts = torch.histc(u, bins=20, min=0, max=1)
        assert (counts - n / 20).abs().max() < 5 * (n / 20) ** 0.5  # 5 sigma per bin
        assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.03  # neighbours unrelated


def random_settings(rows: int, vocab: int, seed: int = 0) -> list[SamplingParams]:
    """A mix: greedy rows, plain temperature, top-k, top-p, min-p, and all at once."""
    gen = torch.Generator().manual_seed(seed)
    kinds = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.3, top_k=5),
             dict(temperature=1.0, top_p=0.8), dict(temperature=0.9, min_p=0.05),
             dict(temperature=1.1, top_k=int(torch.randint(1, vocab, (1,), generator=gen)), top_p=0.6, min_p=0.01)]
    return [SamplingParams(**kinds[int(torch.randint(len(kinds), (1,), generator=gen))]) for _ in range(rows)]


def test_filter_rows_equals_filter_logits_row_by_row():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)) * 3
    params = random_settings(64, 300)
    s = SamplingTensors.build(params, [0] * 64, [0] * 64, 300)
    together = filter_rows(logits[s.rows], s.temperature, s.top_k, s.top_p, s.min_p, s.any_min_p, s.candidates)
    assert s.candidates == 300  # some sampled row has no top-k: every token ranked
    check_rows_alone(logits[s.rows], [params[i] for i in s.rows], together)


def test_filter_rows_ranks_only_the_widest_top_k_when_every_sampled_row_has_one():
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(6)) * 3
    gen = torch.Generator().manual_seed(7)
    params = [SamplingParams(temperature=0) if i % 3 == 0 else
              SamplingParams(temperature=0.9, top_k=int(torch.randint(1, 40, (1,), generator=gen)), top_p=[1.0, 0.7][i % 2],
                             min_p=[0.0, 0.02][i % 5 == 1]) for i in range(32)]
    s = SamplingTensors.build(params, [0] * 32, [0] * 32, 300)
    assert 0 < s.candidates < 40 and s.rows.tolist() == [i for i in range(32) if i % 3]
    together = filter_rows(logits[s.rows], s.temperature, s.top_k, s.top_p, s.min_p, s.any_min_p, s.candidates)
    check_rows_alone(logits[s.rows], [params[i] for i in s.rows], together)


def check_rows_alone(logits, params, together):
    for row, p in enumerate(params):
        alone = filter_logits(logits[row], p.temperature, p.top_k, p.top_p, p.min_p)
        assert torch.equal(torch.isfinite(together[row]), torch.isfinite(alone)), row
        assert torch.allclose(together[row][torch.isfinite(alone)], alone[torch.isfinite(alone)])


def test_batched_sampling_equals_each_row_alone():
    """A row's token depends on its logits, settings, seed and counter only, not on its neighbours."""
    logits = torch.randn(40, 200, generator=torch.Generator().manual_seed(4))
    params = random_settings(40, 200, seed=1)
    seeds, counters = list(range(100, 140)), [3 * i for i in range(40)]
    together = sample_next_tokens(logits, params, seeds, counters)
    alone = [sample_next_tokens(logits[i:i + 1], [params[i]], [seeds[i]], [counters[i]])[0] for i in range(40)]
    assert together == alone
    assert together != sample_next_tokens(logits, params, [s + 1 for s in seeds], counters)  # the seed matters


def test_sampled_rows_follow_their_filtered_distribution():
    """Exactness: each setting's draws against the distribution it defines (total variation within noise)."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(5)) * 1.5
    n = 6000
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=4),
                   SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.1, top_p=0.9)):
        target = torch.softmax(filter_logits(logits[0], params.temperature, params.top_k, params.top_p, params.min_p), -1)
        draws = sample_next_tokens(logits.expand(n, -1), [params] * n, [11] * n, list(range(n)))
        freq = torch.bincount(torch.tensor(draws), minlength=12).float() / n
        noise = sum(float((p * (1 - p) / (2 * torch.pi * n)) ** 0.5) for p in target)
        assert 0.5 * float((freq - target).abs().sum()) < 3 * noise + 1e-9, params
        assert float(freq[target == 0].sum()) == 0  # never a filtered token


def test_a_top_p_below_float32_keeps_the_top_token():
    logits = torch.tensor([[0.1, 2.0, 0.3]])
    assert sample_next_tokens(logits, [SamplingParams(top_p=1e-300)], [0], [0]) == [1]


def test_the_sampler_dispatches_the_same_operations_at_any_batch_size():
    """On a GPU each operation is a kernel launch: their number must not grow with the batch."""
    counts = {}
    for rows in (2, 256):
        logits = torch.randn(rows, 100)
        params = (random_settings(rows, 100) if rows > 2 else
                  [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9, min_p=0.01)])
        with OpCounter() as ops:
            sample_next_tokens(logits, params, list(range(rows)), [0] * rows)
        counts[rows] = ops.count
    assert counts[256] == counts[2], counts
