"""The fixed evaluation set: perplexity through the engine equals the model's own, greedy agreement behaves."""
import math

import pytest
import torch

from minfer.lab.evaluate import (EVAL_PROMPTS, context_windows, eval_set_info, greedy_agreement, greedy_reference, perplexity,
                             token_nlls)
from minfer.texts import eval_text, eval_tokens

SMALL = dict(num_tokens=160, window=64, stride=32)  # the same code path as the full set, in seconds


@pytest.mark.parametrize("num_tokens,window,stride", [(4096, 512, 256), (160, 64, 32), (100, 64, 64), (10, 64, 8)])
def test_every_token_but_the_first_is_scored_once_with_enough_context(num_tokens, window, stride):
    spans = context_windows(num_tokens, window, stride)
    scored = [i for _, end, first in spans for i in range(first, end)]
    assert scored == list(range(1, num_tokens))
    for start, end, first in spans:
        assert end - start <= window
        assert start == 0 or first - start >= window - stride  # context before the first scored token


def test_bad_windows_and_lengths_are_rejected(llm):
    for window, stride in [(64, 0), (64, 65), (1, 1), (64.0, 32)]:
        with pytest.raises(ValueError, match="stride"):
            context_windows(100, window, stride)
    with pytest.raises(ValueError, match="num_tokens"):
        eval_tokens(llm.tokenizer, 10**7)
    with pytest.raises(ValueError, match="window"):
        perplexity(llm, num_tokens=100, window=llm.max_model_len, stride=8)


def test_eval_set_is_fixed(llm):
    assert eval_tokens(llm.tokenizer) == eval_tokens(llm.tokenizer)
    assert len(eval_tokens(llm.tokenizer)) == 4096
    assert eval_text().startswith(eval_text(("execmodel",)))
    assert eval_set_info(llm.tokenizer)["tokens_sha256"] == eval_set_info(llm.tokenizer)["tokens_sha256"]


def direct_nlls(model, ids: list[int], num_tokens: int, window: int, stride: int) -> list[float]:
    """The same windows, run through llm.model directly (no engine, no paged cache)."""
    nlls = []
    for start, end, first in context_windows(num_tokens, window, stride):
        x = torch.tensor([ids[start:end]])
        logprobs = torch.log_softmax(model(x, torch.arange(end - start)[None], last_only=False)[0].float(), -1)
        nlls += [-logprobs[i - start - 1, ids[i]].item() for i in range(first, end)]
    return nlls


def test_perplexity_equals_exp_mean_nll_of_the_model(llm):
    ids = eval_tokens(llm.tokenizer, SMALL["num_tokens"])
    expected = direct_nlls(llm.model, ids, **SMALL)
    assert token_nlls(llm, **SMALL) == pytest.approx(expected, abs=2e-4)
    assert perplexity(llm, **SMALL) == pytest.approx(math.exp(sum(expected) / len(expected)), rel=1e-4)


@pytest.mark.slow
def test_perplexity_matches_transformers(llm, hf_reference_model):
    ids = eval_tokens(llm.tokenizer, 96)
    with torch.no_grad():
        logits = hf_reference_model(torch.tensor([ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1)
    expected = [-logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert token_nlls(llm, num_tokens=96, window=96, stride=96) == pytest.approx(expected, abs=1e-3)


@pytest.mark.slow
def test_greedy_agreement(llm):
    prompts = EVAL_PROMPTS[:4]
    reference = greedy_reference(llm, prompts, max_tokens=8)
    assert [len(c) for c in reference.continuations] == [8] * 4
    # the reference's teacher-forced top-1 is (up to near-ties) its own greedy continuation
    matches = sum(a == b for c, t in zip(reference.continuations, reference.top1) for a, b in zip(c, t))
    assert matches >= 30
    assert greedy_agreement(llm, reference) == 1.0
    assert greedy_agreement(llm, llm, prompts[:2], max_tokens=4) == 1.0  # a reference LLM works too
    ppl = perplexity(llm, **SMALL)
    weights = [layer.mlp.down_proj.weight for layer in llm.model.layers]
    saved = [w.detach().clone() for w in weights]
    gen = torch.Generator().manual_seed(0)
    try:  # noise on every MLP output matrix of the session model, put back afterwards
        with torch.no_grad():
            for w in weights:
                w.add_(torch.randn(w.shape, generator=gen) * w.std() * 0.5)
        agreement = greedy_agreement(llm, reference)
        assert 0.0 < agreement < 1.0
        assert perplexity(llm, **SMALL) > ppl
    finally:
        with torch.no_grad():
            for w, s in zip(weights, saved):
                w.copy_(s)
    assert greedy_agreement(llm, reference) == 1.0  # the session model is whole again
