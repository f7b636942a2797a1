"""Chapter 01: the decoder's parts against the engine's modules and transformers', then the whole."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as hf

from minfer import SamplingParams
from minfer.layers.attention import attention_reference
from minfer.layers.sampler import filter_logits
from minfer.models.llama import LlamaModel, RotaryEmbedding, apply_rope
from minfer.models.loader import hf_config_to_model_config

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
            tie_word_embeddings=False, model_type="llama")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ----------------------------------------------------------------- pieces

def test_rms_norm_matches_engine_and_transformers(impl, llm, gen):
    engine_norm = llm.model.layers[0].input_layernorm  # real trained weights
    x = torch.randn(2, 5, llm.config.hidden_size, generator=gen) * 3
    ours = impl.rms_norm(x, engine_norm.weight.detach(), engine_norm.eps)
    torch.testing.assert_close(ours, engine_norm(x), rtol=1e-5, atol=1e-5)
    theirs = hf.LlamaRMSNorm(x.shape[-1], eps=engine_norm.eps)
    theirs.weight.data.copy_(engine_norm.weight.detach())
    torch.testing.assert_close(ours, theirs(x), rtol=1e-5, atol=1e-5)


def test_rms_norm_keeps_dtype(impl, gen):
    x = torch.randn(3, 8, generator=gen).to(torch.bfloat16)
    assert impl.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6).dtype == torch.bfloat16


def test_rotate_half_matches_transformers(impl, gen):
    x = torch.randn(2, 3, 4, 8, generator=gen)
    torch.testing.assert_close(impl.rotate_half(x), hf.rotate_half(x))


def test_rope_matches_engine_and_transformers(impl, gen):
    head_dim, theta = 16, 10000.0
    positions = torch.tensor([[0, 1, 2, 7], [3, 9, 30, 31]])
    q = torch.randn(2, 4, 4, head_dim, generator=gen)
    k = torch.randn(2, 2, 4, head_dim, generator=gen)
    cos, sin = impl.rope_cos_sin(positions, head_dim, theta)
    assert cos.shape == sin.shape == (2, 4, head_dim)
    engine = RotaryEmbedding(head_dim, 64, theta)
    torch.testing.assert_close(impl.apply_rope(q, cos, sin), apply_rope(q, *engine(positions, q.dtype)), rtol=1e-5, atol=1e-5)
    hf_q, hf_k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(impl.apply_rope(k, cos, sin), hf_k, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_distance(impl, gen):
    # the point of RoPE: shifting both positions by the same amount leaves q.k unchanged
    q = torch.randn(1, 1, 1, 32, generator=gen)
    k = torch.randn(1, 1, 1, 32, generator=gen)

    def score(pq: int, pk: int) -> torch.Tensor:
        cq, sq = impl.rope_cos_sin(torch.tensor([pq]), 32, 10000.0)
        ck, sk = impl.rope_cos_sin(torch.tensor([pk]), 32, 10000.0)
        return (impl.apply_rope(q, cq, sq) * impl.apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-3)


@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", [(4, 4, 5, 5), (6, 2, 5, 5), (6, 2, 3, 7), (4, 1, 1, 9)])
def test_gqa_attention_matches_reference(impl, gen, heads, kv_heads, q_len, kv_len):
    q = torch.randn(2, heads, q_len, 16, generator=gen)
    k = torch.randn(2, kv_heads, kv_len, 16, generator=gen)
    v = torch.randn(2, kv_heads, kv_len, 16, generator=gen)
    torch.testing.assert_close(impl.gqa_attention(q, k, v, None), attention_reference(q, k, v, None),
                               rtol=1e-5, atol=1e-5)


def test_gqa_attention_obeys_an_explicit_mask(impl, gen):
    q, k, v = (torch.randn(2, h, 4, 8, generator=gen) for h in (4, 2, 2))
    mask = torch.rand(2, 1, 4, 4, generator=gen) < 0.6
    mask[..., 0] = True  # every query sees something
    torch.testing.assert_close(impl.gqa_attention(q, k, v, mask), attention_reference(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)


def test_gqa_attention_runs_the_real_engine(impl, llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]  # two lengths: left padding, explicit mask
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.set_attention(impl.gqa_attention)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.set_attention("sdpa")
    assert got == expected


def test_swiglu_matches_engine_mlp(impl, llm, gen):
    mlp = llm.model.layers[3].mlp
    gate, up = mlp.gate_up_proj.weight.detach().split(mlp.intermediate_size, dim=0)
    x = torch.randn(2, 3, llm.config.hidden_size, generator=gen)
    # 1e-3: the engine's linears are prepacked for oneDNN, which sums in another order than F.linear.
    torch.testing.assert_close(impl.swiglu_mlp(x, gate, up, mlp.down_proj.weight.detach()), mlp(x),
                               rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------- the whole decoder

@pytest.mark.parametrize("tied", [False, True])
def test_forward_matches_transformers_and_engine(impl, tied):
    torch.manual_seed(0)
    cfg = dict(TINY, tie_word_embeddings=tied)
    reference = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    weights = {name: t.detach() for name, t in reference.state_dict().items()}
    if tied:
        weights.pop("lm_head.weight", None)  # a tied checkpoint has no head of its own
    config = hf_config_to_model_config(cfg)
    ids = torch.randint(0, cfg["vocab_size"], (2, 9))
    with torch.inference_mode():
        ours = impl.forward(weights, config, ids)
        theirs = reference(ids).logits
    assert ours.shape == (2, 9, cfg["vocab_size"])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    engine = LlamaModel.from_weights(config, weights)
    torch.testing.assert_close(ours, engine(ids, torch.arange(9).expand(2, 9), last_only=False), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------- sampling

def test_greedy_is_argmax_per_row(impl, gen):
    logits = torch.randn(3, 4, 50, generator=gen)
    assert torch.equal(impl.greedy(logits), logits.argmax(-1))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 1.0])
def test_top_p_filter_keeps_what_the_engine_keeps(impl, gen, top_p):
    logits = torch.randn(200, generator=gen) * 2
    ours = impl.top_p_filter(logits, top_p)
    engine = filter_logits(logits, temperature=1.0, top_k=0, top_p=top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(engine))
    kept = ~torch.isinf(ours)
    torch.testing.assert_close(ours[kept], logits[kept])  # survivors keep their logits


def test_top_p_one_keeps_the_whole_vocabulary(impl, gen):
    # SmolLM2's vocabulary and a peaked distribution: a float32 running sum of the sorted probabilities
    # reaches 1.0 long before its end, so "mass above < 1.0" would drop thousands of tokens
    logits = torch.randn(2, 49152, generator=gen) * 4
    assert not torch.isinf(impl.top_p_filter(logits, 1.0)).any()


def test_sample_with_temperature_zero_is_greedy(impl, gen):
    logits = torch.randn(4, 30, generator=gen)
    assert torch.equal(impl.sample(logits, temperature=0.0, top_p=0.5, generator=gen), logits.argmax(-1))


def test_sample_draws_from_the_nucleus_in_proportion(impl):
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    gen = torch.Generator().manual_seed(1)
    draws = impl.sample(logits.expand(4000, 5), temperature=1.0, top_p=0.85, generator=gen)
    assert draws.shape == (4000,)
    counts = torch.bincount(draws, minlength=5).float() / len(draws)
    # nucleus {0, 1, 2} (0.5 + 0.3 < 0.85), renormalised to 5/9, 3/9, 1/9
    torch.testing.assert_close(counts, torch.tensor([5 / 9, 3 / 9, 1 / 9, 0, 0]), rtol=0, atol=0.03)


def test_sample_temperature_sharpens(impl):
    logits = torch.log(torch.tensor([0.6, 0.4]))
    gen = torch.Generator().manual_seed(2)
    cold = impl.sample(logits.expand(4000, 2), temperature=0.25, generator=gen).float().mean()
    hot = impl.sample(logits.expand(4000, 2), temperature=4.0, generator=gen).float().mean()
    # share of token 1: 0.4^4/(0.6^4+0.4^4) ~ 0.16 when cold, ~ 0.47 when hot
    assert abs(float(cold) - 0.165) < 0.03 and abs(float(hot) - 0.475) < 0.03
