"""Quantization-aware fine-tuning (minfer/lab/qat.py): straight-through fake quantization, what is trained,
that training lowers the loss, that the deployed int4 model computes what training saw, and the text kept apart."""
import copy

import pytest
import torch

from minfer import LLM
from minfer.config import ModelConfig
from minfer.lab.evaluate import perplexity
from minfer.models.llama import LlamaModel
from minfer.quant.awq import fake_quantize_int4
from minfer.quant.linear import Int4Linear, quantize_model
from minfer.lab.qat import (FakeQuantLinear, finish_qat, logits_of, model_perplexity, prepare_qat,
                              quantization_errors, straight_through, train_qat, training_topics)
from minfer.lab.distill import distillation_loss
from minfer.texts import EVAL_TOPICS, eval_text, eval_tokens


def tiny_model(seed: int = 0) -> LlamaModel:
    """A random 2-layer model whose layers matter (larger weights, a smaller embedding than the default init)."""
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=64, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaModel(config).eval()
    with torch.no_grad():
        model.embed_tokens.weight.mul_(0.2)
        for layer in model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                linear.weight.mul_(4.0)
    return model


def token_batch(rows=4, length=24, seed=1) -> torch.Tensor:
    return torch.randint(0, 96, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_straight_through_rounds_forward_and_passes_gradients_back():
    w = (torch.randn(8, 128, generator=torch.Generator().manual_seed(0)) * 0.05).requires_grad_(True)
    out = straight_through(w, 64)
    torch.testing.assert_close(out.detach(), fake_quantize_int4(w.detach(), 64))
    upstream = torch.randn(8, 128)
    (out * upstream).sum().backward()
    assert torch.equal(w.grad, upstream)  # rounding's own gradient would be zero


def test_prepare_qat_trains_only_the_chosen_matrices_and_rounds_all_four():
    float_model, model = tiny_model(), tiny_model()
    params = prepare_qat(model, ("qkv_proj", "down_proj"))
    assert len(params) == 2 * 2 and all(p.requires_grad for p in params)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.qkv_proj", "mlp.down_proj")}
    assert isinstance(model.layers[0].self_attn.qkv_proj, FakeQuantLinear)
    # the frozen ones hold their rounding; every matrix acts as its int4 rounding
    reference = copy.deepcopy(float_model)
    with torch.no_grad():
        for layer in reference.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                linear.weight.copy_(fake_quantize_int4(linear.weight, 64))
    ids = token_batch()
    torch.testing.assert_close(logits_of(model, ids), logits_of(reference, ids))


def test_training_lowers_the_distillation_loss_and_the_deployed_int4_model_matches():
    teacher, model = tiny_model(), tiny_model()
    params = prepare_qat(model, ("qkv_proj", "down_proj", "o_proj", "gate_up_proj"))
    ids = token_batch()
    kl = lambda: distillation_loss(logits_of(model, ids), logits_of(teacher, ids)).item()
    with torch.no_grad():
        before = kl()
    losses = train_qat(model, teacher, params, [ids], steps=20, lr=3e-3, warmup=2)
    with torch.no_grad():
        after = kl()
    assert len(losses) == 20 and after < 0.5 * before
    with torch.no_grad():
        trained = logits_of(model, ids)
    finish_qat(model)
    assert not any(p.requires_grad for p in model.parameters())
    quantize_model(model, "int4", 64, backend="reference", head=None)
    assert isinstance(model.layers[1].mlp.down_proj, Int4Linear)
    with torch.no_grad():  # int4 of the tuned weights computes what the fake-quantized model computed
        torch.testing.assert_close(logits_of(model, ids), trained, rtol=1e-3, atol=1e-3)


def test_quantization_errors_per_matrix():
    float_model = tiny_model()
    quantized = quantize_model(copy.deepcopy(float_model), "int4", 64, backend="reference")
    errors = quantization_errors(float_model, quantized)
    assert set(errors) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    w = torch.cat([layer.mlp.down_proj.weight.flatten() for layer in float_model.layers])
    w_hat = torch.cat([layer.mlp.down_proj.dequantize().flatten() for layer in quantized.layers])
    assert errors["down_proj"] == pytest.approx(((w_hat - w).norm() / w.norm()).item(), rel=1e-4)
    assert quantization_errors(float_model, float_model)["qkv_proj"] == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="trainable must name"):
        prepare_qat(tiny_model(), ("q_proj",))
    with pytest.raises(ValueError, match="trainable must name"):
        prepare_qat(tiny_model(), ())
    model = tiny_model()
    params = prepare_qat(model)
    with pytest.raises(ValueError, match="steps and lr must be positive"):
        train_qat(model, tiny_model(), params, [token_batch()], steps=0)


def test_training_text_is_kept_apart_from_the_evaluation_text():
    from pydoc_data.topics import topics

    chosen = training_topics()
    assert chosen and not set(chosen) & set(EVAL_TOPICS)
    assert "compound" not in chosen and "naming" not in chosen  # both repeat evaluation text
    eval_lines = {line.strip() for line in eval_text().splitlines() if len(line.strip()) > 60}
    assert not any(line.strip() in eval_lines for name in chosen for line in topics[name].splitlines())


def test_model_perplexity_equals_the_engines(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32")
    ids = eval_tokens(llm.tokenizer, 300)
    engine = perplexity(llm, 300, 128, 64)
    assert model_perplexity(llm.model, ids, 128, 64) == pytest.approx(engine, rel=1e-4)
