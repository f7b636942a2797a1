"""Speculative decoding is lossless: greedy output equals plain greedy token for token, and sampled
output follows the target's exact distribution (checked against enumerated probabilities, with a
negative control showing that a wrong acceptance rule fails the same bound). The per-token alpha of
the expected-speedup formula is recovered from drafts whose acceptance is known by construction."""
import dataclasses
import math
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minfer import SamplingParams
from minfer.engine.engine import Engine
from minfer.lab.host_sync import DeviceCopies
from minfer.models.llama import LlamaModel
from minfer.models.loader import load_model
from minfer.outputs import RequestMetrics
from minfer.sequence import Sequence
from minfer.speculative import DraftModelProposer, NgramProposer, Proposer, SpecDecodeStats, ngram_lookup, rejection_sample
from minfer.speculative.stats import alpha_from_mean_acceptance_length, expected_tokens_per_pass

VOCAB = 512  # the vocabulary of tiny_small_vocab_dir: small enough to keep the sampling test fast and enumerable


@pytest.fixture
def tiny_llm(make_tiny_llm):
    """tiny_llm(**engine_args) -> a new LLM over tiny_small_vocab_dir with its whole 512-token window."""
    return lambda **engine_args: make_tiny_llm("small_vocab", max_model_len=512, **engine_args)


def perturb(model, scale: float, noise: float, seed: int) -> None:
    """Sharpen the output head (random models are nearly uniform) and add noise (a draft that
    resembles the target without equalling it)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for param in model.parameters():
            param.add_(noise * param.abs().mean() * torch.randn(param.shape, generator=gen))


def run_engine(llm, prompts, params, proposer=None, k=0, num_blocks=512, block_size=16, **kwargs):
    """Run requests through a fresh engine around llm's model; check the blocks all come back."""
    engine = Engine(llm.model, llm.tokenizer, device="cpu", num_gpu_blocks_override=num_blocks, block_size=block_size,
                    speculative_model=proposer, num_speculative_tokens=k if proposer else None, **kwargs)
    requests = llm._make_requests(prompts, params)
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        engine.blocks.check_invariants([s.block_table for s in running])
        for s in running:  # no block is kept for rejected drafts
            assert len(s.block_table) <= engine.blocks.blocks_needed(len(s.token_ids) + len(s.spec_token_ids))
    engine.blocks.check_invariants([])
    assert engine.blocks.num_free_blocks == num_blocks
    return [r.to_output().outputs[0] for r in requests], engine


def grounded_prompts(llm):
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [llm.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{topics[t][:250]}"}])
            for t in ("assert", "pass")]


# ------------------------------------------------------------------ the pieces
def test_ngram_lookup():
    tokens = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_lookup(tokens, 2) == [7, 8]  # the latest earlier "1 2 3", not the first
    assert ngram_lookup(tokens, 5) == [7, 8, 1, 2, 3]
    assert ngram_lookup([4, 5, 6, 1, 4, 5, 6], 3, max_n=4) == [1, 4, 5]  # n=4 fails, n=3 matches
    assert ngram_lookup([1, 2, 3, 4], 3) == []  # the last token never occurred before
    assert ngram_lookup([7, 7], 3) == [7]  # a match must leave at least one token after it
    assert ngram_lookup([3], 2) == []
    assert ngram_lookup([1, 2, 9, 2], 2, max_n=2, min_n=2) == []  # only "2" repeats: shorter than min_n


def total_variation(counts: Counter, probs: torch.Tensor, n: int) -> float:
    return 0.5 * sum(abs(counts.get(i, 0) / n - float(probs[i])) for i in range(len(probs)))


def expected_tv_noise(probs: torch.Tensor, n: int) -> float:
    """E[TV] of n exact samples is about sum_i sqrt(p_i (1 - p_i) / (2 pi n)) (half-normal means)."""
    return sum(math.sqrt(float(p) * (1 - float(p)) / (2 * math.pi * n)) for p in probs)


def sample_first_two(rule, p0, p1, q, n, seed=0):
    """Draw a draft of 2 tokens from q, verify with `rule`; the first emitted token and, when the
    first draft was accepted, the second."""
    gen = torch.Generator().manual_seed(seed)
    first, second = Counter(), Counter()
    target = torch.stack([p0, p1, p1])
    for _ in range(n):
        drafts = [int(torch.multinomial(q, 1, generator=gen)) for _ in range(2)]
        out = rule(drafts, torch.stack([q, q]), target, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def always_accept(drafts, q, target, gen):  # wrong: emits the draft's distribution
    return drafts + [int(torch.multinomial(target[-1], 1, generator=gen))]


def resample_from_target(drafts, q, target, gen):  # wrong: the right test, then the wrong distribution
    for i, t in enumerate(drafts):
        if torch.rand((), generator=gen) * q[i][t] >= target[i][t]:
            return drafts[:i] + [int(torch.multinomial(target[i], 1, generator=gen))]
    return drafts + [int(torch.multinomial(target[-1], 1, generator=gen))]


def test_rejection_sampling_is_lossless_and_wrong_rules_are_caught():
    p0 = torch.tensor([0.30, 0.02, 0.20, 0.05, 0.15, 0.08, 0.00, 0.20])
    p1 = torch.tensor([0.05, 0.40, 0.05, 0.10, 0.05, 0.05, 0.25, 0.05])
    q = torch.tensor([0.05, 0.30, 0.05, 0.30, 0.05, 0.05, 0.15, 0.05])  # overlaps the target only partly
    n = 12000
    bound = 3 * expected_tv_noise(p0, n)  # about 0.03
    first, second = sample_first_two(rejection_sample, p0, p1, q, n)
    assert total_variation(first, p0, n) < bound
    m = sum(second.values())
    assert m > 2000 and total_variation(second, p1, m) < 3 * expected_tv_noise(p1, m)
    for wrong in (always_accept, resample_from_target):  # the same bound must reject a wrong rule
        first, _ = sample_first_two(wrong, p0, p1, q, n)
        assert total_variation(first, p0, n) > 2 * bound, wrong.__name__


def test_rejection_sampling_with_one_hot_guesses():
    """n-gram guesses carry no distribution: accepted with probability p(guess), else resampled
    from p without the guess."""
    p = torch.tensor([0.1, 0.6, 0.3])
    gen = torch.Generator().manual_seed(1)
    n = 6000
    counts = Counter(rejection_sample([1], None, torch.stack([p, p]), gen)[0] for _ in range(n))
    assert total_variation(counts, p, n) < 3 * expected_tv_noise(p, n)


# ------------------------------------------------------------------ the engine, sampling
def exact_joint(model, prompt, top_k, length):
    """The target's exact probability of every top-k continuation of `length` tokens."""
    from minfer.speculative import processed_probs

    params = SamplingParams(temperature=1.0, top_k=top_k)
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in joint.items():
            ids = torch.tensor([prompt + list(seq)])
            probs = processed_probs(model(ids, torch.arange(ids.shape[1])[None])[0], params)[0]
            for token in torch.nonzero(probs).flatten().tolist():
                grown[seq + (token,)] = prob * float(probs[token])
        joint = grown
    return joint


@pytest.mark.slow
def test_sampled_speculation_matches_the_target_distribution(tiny_llm, tiny_small_vocab_dir):
    """Temperature 1, top-k 3, a draft that differs from the target: the empirical law of the
    first three output tokens (one from the prefill, two from a verification pass with 2 drafts)
    matches the target's exact enumerated law."""
    llm = tiny_llm(speculative_model=tiny_small_vocab_dir, num_speculative_tokens=2, max_num_seqs=256)
    perturb(llm.model, 60.0, 0.0, 0)
    perturb(llm.engine.proposer.model, 60.0, 0.1, 1)
    prompt = [17, 250, 3, 99, 401]
    n = 2000
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids[:3]) for o in outputs)
    exact = exact_joint(llm.model, prompt, 3, 3)
    keys = sorted(exact)
    probs = torch.tensor([exact[k] for k in keys])
    tv = 0.5 * (sum(abs(counts.get(k, 0) / n - exact[k]) for k in keys) + sum(c for k, c in counts.items() if k not in exact) / n)
    assert tv < 3 * expected_tv_noise(probs, n)
    stats = llm.engine.spec_stats
    assert 0.2 < stats.draft_acceptance_rate < 0.9  # both paths ran: accepts and residual resamples
    assert stats.acceptance_rate_per_position[1] < stats.acceptance_rate_per_position[0]
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


# ------------------------------------------------------------------ the engine, greedy
def test_greedy_ngram_and_drafts_equal_plain_greedy(llm, random_draft):
    """SmolLM2 as the target: n-gram lookup, the target as its own draft (accepts everything) and an
    unrelated tiny draft (accepts almost nothing) all give the plain greedy tokens, two at a time."""
    prompts = grounded_prompts(llm)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (24, 16)]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ngram, engine = run_engine(llm, prompts, params, NgramProposer(), 4)
    assert [o.token_ids for o in ngram] == plain
    assert engine.spec_stats.draft_acceptance_rate > 0.13  # measured 0.40 (22 of 55 guesses): 3x headroom
    own, engine = run_engine(llm, prompts[:1], params[:1], DraftModelProposer(llm.model, llm.config.vocab_size), 3)
    assert own[0].token_ids == plain[0]
    assert engine.spec_stats.draft_acceptance_rate == 1.0
    assert engine.stats.steps < len(plain[0]) / 2  # several tokens per pass
    other, engine = run_engine(llm, prompts[:1], params[:1], DraftModelProposer(random_draft, llm.config.vocab_size), 2)
    assert other[0].token_ids == plain[0]
    assert engine.spec_stats.draft_acceptance_rate < 0.5


@pytest.fixture(scope="module")
def random_draft(tiny_checkpoint, llm):
    """A tiny random Llama over SmolLM2's vocabulary with a reduced output head: it proposes only
    among the 2000 tokens of `head_token_ids` (as a draft trained on frequent tokens would)."""
    loaded = load_model(tiny_checkpoint(tie=False, max_position_embeddings=8192), torch.float32)
    loaded.weights["lm_head.weight"] = loaded.weights["lm_head.weight"][:2000]
    config = dataclasses.replace(loaded.config, vocab_size=llm.config.vocab_size)
    with torch.device("meta"):
        model = LlamaModel(config)
    model.lm_head = torch.nn.Linear(config.hidden_size, 2000, bias=False)
    model = model.to_empty(device="cpu")
    model.rope = type(model.rope)(config.head_dim, config.max_position_embeddings, config.rope_theta)
    model.load_weights(loaded.weights)
    model.head_token_ids = torch.arange(2000) * 20  # spread over the vocabulary
    return model.eval()


def test_concurrent_speculation_equals_solo_and_respects_stops(llm):
    prompts = grounded_prompts(llm)
    plain = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    stop_token, stop_text = plain.token_ids[9], llm.tokenizer.decode(plain.token_ids[14:16])
    params = [SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0, max_tokens=20, stop=stop_text),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token])]
    expected = [o.outputs[0] for o in llm.generate([prompts[0]] * 3, params, use_tqdm=False)]
    together, _ = run_engine(llm, [prompts[0]] * 3, params, NgramProposer(), 6)
    for got, want in zip(together, expected):
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
               (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert len(together[0].token_ids) == 7 and together[2].token_ids[-1] == stop_token


def test_tight_pool_with_preemption_equals_plain(tiny_llm):
    """Many sequences, small blocks, a pool too small: drafts get cut, sequences preempted, prefix
    blocks sealed mid-speculation; the output still equals plain greedy and only accepted tokens
    ever reach the prefix cache."""
    llm = tiny_llm()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]} for _ in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 60), ignore_eos=True) for _ in prompts]
    plain, _ = run_engine(llm, prompts, params, num_blocks=400, block_size=4)
    draft = tiny_llm().model
    perturb(draft, 1.0, 0.05, 2)
    spec, engine = run_engine(llm, prompts, params, DraftModelProposer(draft, VOCAB), 4, num_blocks=40, block_size=4,
                              max_num_seqs=8, max_num_batched_tokens=32)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.scheduler.num_preemptions > 0
    draft_blocks = engine.proposer.blocks  # every sequence gave the draft's blocks back as it finished
    assert sorted(draft_blocks.free) == list(range(draft_blocks.pool.num_blocks))
    # measured 0.74 (a lightly perturbed copy of the target): 3x headroom on acceptance and on rejection
    assert 0.25 < engine.spec_stats.draft_acceptance_rate < 0.91
    finals = [p["prompt_token_ids"] + o.token_ids for p, o in zip(prompts, spec)]
    for block in engine.blocks.blocks:  # every sealed block holds a real run of some sequence's tokens
        if block.hash is not None:
            assert any(tuple(f[i:i + 4]) == block.token_ids for f in finals for i in range(0, len(f) - 3, 4))


# ------------------------------------------------------------------ the API
def test_llm_speculative_api_and_metrics(tiny_llm):
    llm = tiny_llm(speculative_model="[ngram]", num_speculative_tokens=3)
    plain = tiny_llm()
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.engine.spec_stats.as_dict()
    assert stats["num_draft_tokens"] >= stats["num_accepted_tokens"]
    assert stats["draft_acceptance_rate"] > 0.14  # measured 0.43 (6 of 14 guesses on a repeating prompt): 3x headroom
    assert stats["mean_acceptance_length"] == 1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    assert len(stats["acceptance_rate_per_position"]) == 3
    # vLLM's current form of the same request, with the lookup's n-gram sizes
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    by_config = tiny_llm(speculative_config=config)
    proposer = by_config.engine.proposer
    assert isinstance(proposer, NgramProposer) and (proposer.max_n, proposer.min_n) == (3, 2)
    assert by_config.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert by_config.engine.spec_stats.as_dict()["num_drafts"] > 0


def test_bad_speculative_arguments(tiny_llm, tiny_checkpoint):
    for kwargs, match in [(dict(speculative_model="[ngram]"), "go together"),
                          (dict(num_speculative_tokens=3), "go together"),
                          (dict(speculative_model="[ngram]", num_speculative_tokens=0), r"integer in \[1, 16\]"),
                          (dict(speculative_model="[ngram]", num_speculative_tokens=17), r"integer in \[1, 16\]"),
                          (dict(speculative_model="[ngram]", num_speculative_tokens=True), r"integer in \[1, 16\]"),
                          (dict(speculative_model="[ngram]", num_speculative_tokens=2.0), r"integer in \[1, 16\]"),
                          (dict(speculative_model=3, num_speculative_tokens=2), "speculative_model must be"),
                          (dict(speculative_config={"method": "eagle", "num_speculative_tokens": 2}), "method 'ngram'"),
                          (dict(speculative_config={"method": "medusa", "model": "x", "num_speculative_tokens": 2}),
                           "method 'ngram'"),
                          (dict(speculative_config={"method": "ngram"}), "needs num_speculative_tokens"),
                          (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                    "prompt_lookup_max": 2.5}), "must be integers"),
                          (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "k": 1}), r"\['k'\]"),
                          (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                                speculative_model="[ngram]"), "not both")]:
        with pytest.raises(ValueError, match=match):
            tiny_llm(**kwargs)
    with pytest.raises(ValueError, match="no-such-draft"):
        tiny_llm(speculative_model="no-such-draft", num_speculative_tokens=2)
    other = tiny_checkpoint(tie=False, vocab_size=VOCAB + 64, max_position_embeddings=512)
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_llm(speculative_model=other, num_speculative_tokens=2)
    short = tiny_checkpoint(tie=False, vocab_size=VOCAB, max_position_embeddings=64)
    with pytest.raises(ValueError, match="64 positions"):
        tiny_llm(speculative_model=short, num_speculative_tokens=2)
    spec = tiny_llm(speculative_model="[ngram]", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="logprobs"):
        spec.generate({"prompt_token_ids": [1, 2]}, SamplingParams(logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="serving engine"):
        spec.generate({"prompt_token_ids": [1, 2]}, SamplingParams(), use_tqdm=False, batching="static")


def test_expected_speedup_formula():
    from minfer.lab.bench.spec import expected_speedup

    # k = 4, alpha = 0.8: 1 + 0.8 + 0.64 + 0.512 + 0.4096 tokens per pass, for 1 + 4 * 0.05 target steps
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert expected_speedup(0.8, 4, 0.05, verify_cost=1.15) == pytest.approx(3.3616 / 1.35)
    assert expected_speedup(0.5, 4, 0.05) == pytest.approx(1.9375 / 1.2)
    assert expected_tokens_per_pass(1.0, 3) == 4 and expected_speedup(0.0, 5, 0.0) == 1.0
    for c, verify_cost in [(-0.1, 1.0), (0.1, 0.0), (float("nan"), 1.0)]:
        with pytest.raises(ValueError, match="c >= 0 and verify_cost > 0"):
            expected_speedup(0.5, 4, c, verify_cost)


# ------------------------------------------------------------------ the alpha of the formula
def simulate_passes(stats: SpecDecodeStats, alpha: float, draft_lengths: list[int], rng: random.Random) -> None:
    """Record one verification pass per draft length: each draft token accepted with probability
    alpha, independently, up to the first rejection."""
    for k in draft_lengths:
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        stats.record(k, accepted)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.95])
def test_alpha_estimators_recover_a_known_alpha(alpha, k):
    """20000 simulated passes: both estimators recover alpha within 0.02 (their sampling error is
    below 0.005 here), while vLLM's draft_acceptance_rate is the other quantity the theory says."""
    rng = random.Random(int(alpha * 100) * 10 + k)
    stats = SpecDecodeStats()
    simulate_passes(stats, alpha, [k] * 20000, rng)
    assert stats.alpha == pytest.approx(alpha, abs=0.02)
    assert alpha_from_mean_acceptance_length(stats.mean_acceptance_length, k) == pytest.approx(alpha, abs=0.02)
    assert stats.draft_acceptance_rate == pytest.approx(alpha * (1 - alpha ** k) / ((1 - alpha) * k), abs=0.02)
    for i, rate in enumerate(stats.acceptance_rate_per_position, start=1):
        assert rate == pytest.approx(alpha ** i, abs=0.02)
    if k > 1:  # a late draft token counts only once every earlier one was accepted
        assert stats.draft_acceptance_rate < stats.alpha - 0.02


def test_alpha_with_drafts_of_varying_length():
    """Drafts cut short (lookup found fewer tokens) end without a rejection: the maximum-likelihood
    alpha stays unbiased, where inverting the mean acceptance length at the largest k would not."""
    rng = random.Random(5)
    stats = SpecDecodeStats()
    simulate_passes(stats, 0.7, [rng.randint(1, 6) for _ in range(20000)], rng)
    assert stats.alpha == pytest.approx(0.7, abs=0.02)
    assert alpha_from_mean_acceptance_length(stats.mean_acceptance_length, 6) < 0.65  # measured 0.62


def test_alpha_from_mean_acceptance_length_inverts_the_formula():
    for k in range(1, 9):
        for alpha in [0.0, 0.05, 0.3, 0.5, 0.74, 0.9, 0.99, 1.0]:
            length = expected_tokens_per_pass(alpha, k)
            assert alpha_from_mean_acceptance_length(length, k) == pytest.approx(alpha, abs=1e-9)
    assert alpha_from_mean_acceptance_length(3.0, 4) == pytest.approx(0.741, abs=0.001)


def test_alpha_helpers_refuse_bad_input():
    for alpha in [-0.1, 1.2, float("nan"), "0.5", True]:
        with pytest.raises(ValueError, match=r"alpha must be a probability in \[0, 1\]"):
            expected_tokens_per_pass(alpha, 3)
    for k in [-1, 2.0, True]:
        with pytest.raises(ValueError, match="integer >= 0"):
            expected_tokens_per_pass(0.5, k)
    for length, k in [(0.5, 4), (5.5, 4), (float("nan"), 4)]:
        with pytest.raises(ValueError, match=r"must lie in \[1, k \+ 1\] = \[1, 5\]"):
            alpha_from_mean_acceptance_length(length, k)
    for k in [0, 3.0]:
        with pytest.raises(ValueError, match="integer >= 1"):
            alpha_from_mean_acceptance_length(1.0, k)
    assert SpecDecodeStats().alpha == 0.0  # nothing drafted yet


class KnownAlphaProposer(Proposer):
    """A synthetic draft whose acceptance is known: at each draft position it proposes the target's
    own greedy token with probability alpha, independently, and a wrong token otherwise."""

    def __init__(self, greedy: dict[tuple[int, ...], list[int]], alpha: float, vocab_size: int, seed: int):
        self.greedy, self.alpha, self.vocab_size, self.rng = greedy, alpha, vocab_size, random.Random(seed)

    def propose(self, seqs, num_tokens):
        proposals = []
        for seq, k in zip(seqs, num_tokens):
            done = len(seq.output_ids)
            right = self.greedy[tuple(seq.prompt_token_ids)][done:done + k]
            proposals.append(([t if self.rng.random() < self.alpha else (t + 1) % self.vocab_size for t in right], None))
        return proposals


def test_a_proposer_that_guesses_more_than_asked_is_stopped(tiny_llm):
    class Eager(Proposer):
        def propose(self, seqs, num_tokens):
            return [([7] * (k + 1), None) for k in num_tokens]

    llm = tiny_llm()
    with pytest.raises(RuntimeError, match="Eager.propose gave 4 draft tokens for a sequence that asked for at most 3"):
        run_engine(llm, [{"prompt_token_ids": [1, 2, 3]}], [SamplingParams(max_tokens=20, ignore_eos=True)], Eager(), 3)


def test_engine_measures_the_alpha_of_a_synthetic_draft(tiny_llm):
    """Through the engine (greedy, 64 sequences at once): the spec stats' alpha recovers the draft's
    known alpha within 0.02 (over about 5800 accept-or-reject trials its sampling error is about 0.0065)."""
    alpha, k = 0.6, 3
    llm = tiny_llm(max_num_seqs=64)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(8)]} for _ in range(64)]
    params = [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)] * len(prompts)
    plain = llm.generate(prompts, params, use_tqdm=False)
    greedy = {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    assert len(greedy) == len(prompts)
    spec, engine = run_engine(llm, prompts, params, KnownAlphaProposer(greedy, alpha, VOCAB, seed=1), k,
                              num_blocks=1024, max_num_seqs=64)
    assert [o.token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = engine.spec_stats
    assert stats.alpha == pytest.approx(alpha, abs=0.02)
    assert alpha_from_mean_acceptance_length(stats.mean_acceptance_length, k) == pytest.approx(alpha, abs=0.02)
    assert stats.draft_acceptance_rate == pytest.approx(alpha * (1 - alpha ** k) / ((1 - alpha) * k), abs=0.02)


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llm, tiny_small_vocab_dir):
    """A seeded request draws drafts, acceptances and resamples from its own generator: the same
    tokens whatever shares the batch, as long as its drafts are not cut (here it is the oldest request, first to
    the step's budget; a request whose drafts the others' load cuts keeps only the distribution); its n
    completions differ from each other."""
    llm = tiny_llm(speculative_model=tiny_small_vocab_dir, num_speculative_tokens=3)
    perturb(llm.model, 20.0, 0.0, 0)
    perturb(llm.engine.proposer.model, 20.0, 0.1, 3)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=7, n=2, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5]}
    alone = llm.generate(prompt, params, use_tqdm=False)[0]
    company = llm.generate([{"prompt_token_ids": [9, 9, 2]}, prompt], [SamplingParams(seed=1, max_tokens=12), params],
                           use_tqdm=False)[1]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in company.outputs]
    assert alone.outputs[0].token_ids != alone.outputs[1].token_ids
    assert all(len(o.token_ids) == 30 for o in alone.outputs)
    assert llm.engine.spec_stats.draft_acceptance_rate > 0.19  # measured 0.57 (36 of 63): 3x headroom


def test_the_drafts_pool_grows_and_keeps_what_it_holds(tiny_llm):
    """Out of blocks, the draft's pool doubles: the K/V already stored move with it, blocks come lowest first."""
    from minfer.speculative.batched_drafting import DraftPool

    blocks = DraftPool(tiny_llm().model, 2, 4)
    first, second = [], []
    blocks.extend(first, 7)  # two blocks: the whole pool
    blocks.pool.k[:, :, first] = 1.5
    blocks.extend(second, 5)  # two more: the pool doubles
    assert first == [0, 1] and second == [2, 3] and blocks.pool.num_blocks == 4 and not blocks.free
    assert (blocks.pool.k[:, :, first] == 1.5).all() and (blocks.pool.k[:, :, second] == 0).all()
    blocks.release(first)
    blocks.extend(second, 12)  # three blocks: the freed ones come back lowest first
    assert second == [2, 3, 0] and first == [] and blocks.free == [1]


class ScalarReads(TorchDispatchMode):
    """Counts reads of one tensor element into Python (`int(t)`, `t.item()`): on a GPU each waits for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=20),
                                    SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_draft_pass_reads_no_token_into_python_until_it_ends(tiny_llm, params):
    """The draft's k forward passes chain on the device: its guesses reach the host once, after the pass."""
    llm = tiny_llm()
    proposer = DraftModelProposer(llm.model, VOCAB)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    seq = Sequence(prompt, params, params.max_tokens, 3, RequestMetrics(0.0, num_prompt_tokens=len(prompt)))
    with ScalarReads() as reads, DeviceCopies() as copies:
        (drafts, probs), = proposer.propose([seq], [5])
    assert reads.count == 0 and len(drafts) == 5
    assert copies.outside == []  # host data reaches the device queued (minfer.host_copy), never waiting
    assert probs is None if params.greedy else probs.shape == (5, VOCAB)
    if params.greedy:  # the target as its own draft guesses exactly what it would decode
        plain = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
        assert drafts == plain[:5]
