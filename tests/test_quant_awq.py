"""Activation-aware int4 (minfer/quant/awq.py): folding keeps the float model, scaling lowers the error."""
import pytest
import torch
from torch import nn

from minfer import LLM, SamplingParams
from minfer.config import ModelConfig
from minfer.models.llama import LlamaModel
from minfer.quant.awq import apply_awq, clip_groups, fake_quantize_int4, search_clip, search_scale
from minfer.quant.linear import Int4Linear, quantize_model
from minfer.formats.weights import dequantize_int4, pack_int4, quantize_int4_groupwise
from minfer.texts import CALIBRATION_TOPICS, EVAL_TOPICS, calibration_token_ids


def tiny_model(seed: int = 0, skew: float = 1.0) -> LlamaModel:
    """A random 2-layer model with grouped-query attention (4 query heads, 2 KV heads) and q/k/v biases.

    skew: the RMSNorm weights of a few hidden channels are this many times larger (as in trained LLMs).
    """
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=128, tie_word_embeddings=False, attention_bias=True)
    model = LlamaModel(config).eval()
    with torch.no_grad():
        for layer in model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
                norm.weight[:4] *= skew
            layer.self_attn.qkv_proj.bias.normal_(0, 0.5)
    return model


def logits(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, torch.arange(ids.shape[1])[None], last_only=False)


def random_ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_folding_leaves_the_float_model_unchanged():
    model, ids = tiny_model(skew=10.0), torch.tensor([random_ids(40, seed=2)])
    before = logits(model, ids)
    weights = {name: p.clone() for name, p in model.named_parameters()}
    # one alpha: every scale is folded in; no clipping (clipping does change the float weights)
    apply_awq(model, random_ids(512), group_size=32, alphas=(0.5,), clip_ratios=(1.0,))
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, weights[name])]
    for part in ("input_layernorm", "post_attention_layernorm", "qkv_proj.weight", "qkv_proj.bias", "o_proj",
                 "gate_up_proj", "down_proj"):
        assert any(part in name for name in changed), f"{part} was not rescaled"
    assert (logits(model, ids) - before).abs().max().item() <= 1e-4 * before.abs().max().item()


def skewed_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [512, 256] whose channels 0, 37, 100, 200 are 30x larger than the rest; w [64, 256] plain Gaussian."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 256, generator=gen)
    x[:, [0, 37, 100, 200]] *= 30
    return x, torch.randn(64, 256, generator=gen)


def test_activation_aware_scales_lower_the_output_error_of_a_skewed_layer():
    x, w = skewed_layer()
    s, alpha, errors = search_scale(x, w, x.abs().mean(0), group_size=64)
    assert alpha > 0 and min(errors) < 0.5 * errors[0]  # errors[0]: alpha = 0, plain rounding
    # the same through the real format: plain int4 vs int4 of w * s read with x / s
    plain = dequantize_int4(pack_int4(quantize_int4_groupwise(w, 64)[0]), *quantize_int4_groupwise(w, 64)[1:])
    linear = nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w * s)
    scaled = Int4Linear.from_linear(linear, 64, backend="reference")
    exact = x @ w.T
    plain_error = (x @ plain.T - exact).pow(2).mean()
    awq_error = (scaled(x / s) - exact).pow(2).mean()
    assert awq_error < 0.5 * plain_error


def test_clipping_an_outlier_group_lowers_its_error():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 128, generator=gen), torch.randn(16, 128, generator=gen)
    w[:, 5] = 12.0  # one outlier per row stretches the first group's grid ...
    x[:, 5] *= 0.05  # ... and meets a small input: clipping it costs little
    ratio = search_clip(x, w, 64, (1.0, 0.9, 0.8, 0.7, 0.6, 0.5))
    assert (ratio[:, 0] < 1).all()
    error = lambda v: (x @ (w - fake_quantize_int4(v, 64)).T).pow(2).mean()
    assert error(clip_groups(w, ratio, 64)) < error(w)
    assert torch.equal(search_clip(x, w, 64, (1.0,)), torch.ones(16, 2))


def test_awq_model_is_closer_to_the_float_model_than_plain_int4():
    ids, calibration = torch.tensor([random_ids(100, seed=3)]), random_ids(512)
    exact = logits(tiny_model(skew=10.0), ids)
    errors = {}
    for method in ("int4", "awq"):
        model = tiny_model(skew=10.0)
        quantize_model(model, method, 32, backend="reference", head=None,
                       calibration_token_ids=calibration if method == "awq" else None)
        assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
        errors[method] = (logits(model, ids) - exact).pow(2).mean().item()
    assert errors["awq"] < 0.8 * errors["int4"]


def test_calibration_text_is_disjoint_from_the_evaluation_text(llm):
    assert not set(CALIBRATION_TOPICS) & set(EVAL_TOPICS)
    ids = calibration_token_ids(llm.tokenizer, 1000)
    assert len(ids) == 1000 and ids == calibration_token_ids(llm.tokenizer)[:1000]
    with pytest.raises(ValueError, match="num_tokens"):
        calibration_token_ids(llm.tokenizer, 0)


def test_llm_quantization_awq_loads_and_generates(tiny_dir):
    tiny = LLM(tiny_dir, dtype="float32", device="cpu", quantization="awq", quantization_group_size=32)
    assert isinstance(tiny.model.layers[1].self_attn.qkv_proj, Int4Linear)
    assert tiny.model.layers[1].self_attn.qkv_proj.group_size == 32
    out = tiny.generate(["Hello"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_bad_input():
    model = tiny_model()
    with pytest.raises(ValueError, match="calibration_token_ids"):
        quantize_model(model, "awq", 32)
    with pytest.raises(ValueError, match="calibration_token_ids"):
        quantize_model(model, "int4", 32, calibration_token_ids=random_ids(512))
    with pytest.raises(ValueError, match="group size"):
        quantize_model(model, "awq", 128, calibration_token_ids=random_ids(512))
    with pytest.raises(ValueError, match="alphas"):
        apply_awq(model, random_ids(512), 32, alphas=())
    with pytest.raises(ValueError, match="alphas"):
        apply_awq(model, random_ids(512), 32, alphas=(0.5, 1.5))
    with pytest.raises(ValueError, match="clip_ratios"):
        apply_awq(model, random_ids(512), 32, clip_ratios=(0.0,))
    with pytest.raises(ValueError, match="clip_linears"):
        apply_awq(model, random_ids(512), 32, clip_linears=("lm_head",))
    with pytest.raises(ValueError, match="calibration tokens"):
        apply_awq(model, random_ids(10), 32)
    with pytest.raises(ValueError, match="quantization_group_size"):
        LLM("smollm2-135m", quantization="awq", quantization_group_size=48)
    with pytest.raises(ValueError, match="unknown quantization"):
        LLM("smollm2-135m", quantization="AWQ")
