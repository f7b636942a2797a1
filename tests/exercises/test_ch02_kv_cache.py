"""Chapter 02: KV cache sizes, cached attention, and greedy decoding with and without a cache."""
import dataclasses

import pytest
import torch

from minfer import SamplingParams
from minfer.kv_cache import KVCache
from minfer.layers.attention import attention_reference


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ----------------------------------------------------------------- memory

@pytest.mark.parametrize("kv_heads", [9, 3, 1], ids=["mha", "gqa", "mqa"])  # SmolLM2 as it ships is GQA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cache_bytes_match_an_allocated_cache(impl, llm, kv_heads, dtype):
    config = dataclasses.replace(llm.config, num_kv_heads=kv_heads)
    c = config
    batch, context = 2, 48
    allocated = KVCache(config, batch, context, dtype).nbytes
    assert impl.kv_cache_bytes(c.num_layers, kv_heads, c.head_dim, dtype, context, batch) == allocated
    assert impl.kv_bytes_per_token(c.num_layers, kv_heads, c.head_dim, dtype) * batch * context == allocated


def test_bytes_per_token_of_the_real_model(impl, llm):
    c = llm.config
    expected = c.kv_bytes_per_token(torch.float32)  # the engine's formula
    assert impl.kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32) == expected == 46080


# ----------------------------------------------------------------- the cache itself

def test_append_kv_writes_in_place_like_the_engine(impl, llm, gen):
    config = dataclasses.replace(llm.config, num_layers=1)
    engine = KVCache(config, batch_size=2, max_len=10)
    k_cache, v_cache = torch.zeros_like(engine.k[0]), torch.zeros_like(engine.v[0])
    for n in (4, 1, 2):  # a prefill chunk, then single decode tokens
        k_new = torch.randn(2, config.num_kv_heads, n, config.head_dim, generator=gen)
        v_new = torch.randn(2, config.num_kv_heads, n, config.head_dim, generator=gen)
        k_seen, v_seen = impl.append_kv(k_cache, v_cache, k_new, v_new, engine.length)
        k_ref, v_ref = engine.update(0, k_new, v_new)
        engine.advance(n)
        assert torch.equal(k_seen, k_ref) and torch.equal(v_seen, v_ref)
        assert torch.equal(k_cache, engine.k[0]) and torch.equal(v_cache, engine.v[0])  # stored, not copied away


def test_append_kv_refuses_to_overflow(impl):
    k_cache, v_cache = torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError):
        impl.append_kv(k_cache, v_cache, torch.ones(1, 1, 4, 4), torch.ones(1, 1, 4, 4), 0)


@pytest.mark.parametrize("chunks", [[1] * 6, [4, 1, 1], [2, 3, 1]])
def test_cached_attention_equals_full_attention(impl, gen, chunks):
    # run a sequence through in pieces with the cache: the outputs must match one causal pass
    heads, kv_heads, head_dim, total = 6, 2, 8, sum(chunks)
    q = torch.randn(1, heads, total, head_dim, generator=gen)
    k = torch.randn(1, kv_heads, total, head_dim, generator=gen)
    v = torch.randn(1, kv_heads, total, head_dim, generator=gen)
    k_cache, v_cache = torch.zeros(1, kv_heads, total + 2, head_dim), torch.zeros(1, kv_heads, total + 2, head_dim)
    outs, start = [], 0
    for n in chunks:
        s = slice(start, start + n)
        outs.append(impl.cached_attention(q[:, :, s], k[:, :, s], v[:, :, s], k_cache, v_cache, start))
        start += n
    torch.testing.assert_close(torch.cat(outs, dim=2), attention_reference(q, k, v, None), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- decoding the real model

@pytest.fixture(scope="module")
def prompt_and_expected(llm):
    prompt = llm.tokenizer.encode("The three primary colors are", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return prompt, llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "recompute"])
def test_greedy_decode_matches_the_engine(impl, llm, prompt_and_expected, use_cache):
    prompt, expected = prompt_and_expected
    assert impl.greedy_decode(llm.model, prompt, 8, use_cache=use_cache) == expected


def test_greedy_decode_feeds_one_token_per_step_with_a_cache(impl, llm, prompt_and_expected):
    # the cache's whole point: after the prompt, each step runs the model on one new token only
    prompt, _ = prompt_and_expected
    seen: list[int] = []
    hook = llm.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        impl.greedy_decode(llm.model, prompt, 4, use_cache=True)
    finally:
        hook.remove()
    assert seen == [len(prompt), 1, 1, 1]


def test_learner_cache_runs_the_real_model(impl, llm, prompt_and_expected):
    # the engine's cache with its write step replaced by append_kv, inside the real model
    class LearnerCache(KVCache):
        def update(self, layer, k, v):
            return impl.append_kv(self.k[layer], self.v[layer], k, v, self.length)

    prompt, expected = prompt_and_expected
    model, tokens = llm.model, list(prompt)
    cache = LearnerCache(model.config, 1, len(prompt) + 8)
    logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)
    for _ in range(7):
        tokens.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([tokens[-1:]]), torch.tensor([[len(tokens) - 1]]), cache)
    tokens.append(int(logits[0, -1].argmax()))
    assert tokens[len(prompt):] == expected
