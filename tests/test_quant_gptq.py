"""GPTQ (minfer/quant/gptq.py): lower output error than round-to-nearest, and the fast update equals the textbook one."""
import pytest
import torch

from minfer.formats.fp8 import dequantize_fp8_rows, quantize_fp8_rows
from minfer.formats.weights import dequantize_int4, pack_int4, quantize_int4_groupwise, round_to_int4_grid
from minfer.quant.fp8_linear import Fp8Linear
from minfer.quant.gptq import DAMPING, apply_gptq, gptq_quantize, gptq_quantize_fp8, input_hessian
from minfer.quant.linear import Int4Linear, quantize_model
from minfer.config import ModelConfig
from minfer.models.llama import LlamaModel
from minfer.lab.testing import tiny_llama


def tiny_model() -> LlamaModel:
    """A random 3-layer model whose matrix sizes (64, 128) int4 groups of 32 divide (tiny_llama's 48 does not)."""
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=64, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaModel(config).eval()


def correlated_inputs(tokens: int = 1024, features: int = 128, seed: int = 0) -> torch.Tensor:
    """Inputs that move together: 16 hidden factors mixed into 128 channels, plus a little noise."""
    gen = torch.Generator().manual_seed(seed)
    factors = torch.randn(tokens, 16, generator=gen)
    return factors @ torch.randn(16, features, generator=gen) + 0.1 * torch.randn(tokens, features, generator=gen)


def output_error(x: torch.Tensor, w: torch.Tensor, q, scale, minimum) -> float:
    w_hat = dequantize_int4(pack_int4(q), scale, minimum)
    return (x @ (w.double() - w_hat.double()).T.float()).pow(2).mean().item()


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_output_error_is_far_below_round_to_nearest(desc_act):
    x = correlated_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    rtn = output_error(x, w, *quantize_int4_groupwise(w, 32))
    gptq = output_error(x, w, *gptq_quantize(w, input_hessian(x), 32, desc_act=desc_act))
    # Without the error feedback GPTQ would be round-to-nearest on the same grids: equal error.
    assert gptq < 0.25 * rtn


def textbook_gptq(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damping: float = DAMPING,
                  desc_act: bool = False, static_groups: bool = True) -> torch.Tensor:
    """The slow update, written out: after each column, w_F -= e / [H_F^-1]_ii * [H_F^-1]_{i,F}, then
    remove column i from H_F^-1 by Gaussian elimination. No Cholesky, no blocks; float64. A group's
    grid is fitted when its first column comes up, from the weights as they are then (in activation
    order with static_groups: from the weights before any update)."""
    w, h = w.double().clone(), hessian.double().clone()
    columns = w.shape[1]
    h += damping * h.diagonal().mean() * torch.eye(columns, dtype=torch.float64)
    order = torch.argsort(h.diagonal(), descending=True) if desc_act else torch.arange(columns)
    _, scale, minimum = quantize_int4_groupwise(w, group_size)
    fitted = {g for g in range(columns // group_size) if desc_act and static_groups}
    h_inv = torch.linalg.inv(h)
    q = torch.zeros(w.shape, dtype=torch.uint8)
    for step, i in enumerate(order.tolist()):
        g = i // group_size
        if g not in fitted:
            group = slice(g * group_size, (g + 1) * group_size)
            _, scale[:, g:g + 1], minimum[:, g:g + 1] = quantize_int4_groupwise(w[:, group], group_size)
            fitted.add(g)
        q[:, i] = round_to_int4_grid(w[:, i], scale[:, g], minimum[:, g])
        error = w[:, i] - (q[:, i].double() * scale[:, g].double() + minimum[:, g].double())
        rest = order[step:]  # F: this column and those not yet quantized
        w[:, rest] -= (error / h_inv[i, i])[:, None] * h_inv[i, rest][None]
        h_inv = h_inv - torch.outer(h_inv[:, i], h_inv[i, :]) / h_inv[i, i]
    return q


@pytest.mark.parametrize("desc_act, static_groups", [(False, False), (True, False), (True, True)])
def test_blocked_cholesky_update_equals_the_textbook_update(desc_act, static_groups):
    x = correlated_inputs(features=128, seed=2)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    hessian = input_hessian(x).double()
    # blocks of 64 columns: the lazy update between blocks is exercised, and groups of 32 inside them
    # (in activation order a group's columns are spread over both blocks when its grid is fitted)
    q, _, _ = gptq_quantize(w, hessian, 32, block_size=64, desc_act=desc_act, static_groups=static_groups)
    assert torch.equal(q, textbook_gptq(w, hessian, 32, desc_act=desc_act, static_groups=static_groups))


def test_dead_inputs_get_no_error_and_spread_none():
    x = correlated_inputs(seed=4)
    x[:, [5, 70]] = 0  # two inputs that never fire
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    q, scale, minimum = gptq_quantize(w, input_hessian(x), 32)
    assert torch.isfinite(scale.float()).all() and torch.isfinite(minimum.float()).all()
    assert output_error(x, w, q, scale, minimum) < 0.25 * output_error(x, w, *quantize_int4_groupwise(w, 32))


def test_bad_gptq_arguments():
    w, h = torch.randn(8, 64), torch.eye(64)
    with pytest.raises(ValueError, match="multiple of group_size 32"):
        gptq_quantize(w, h, 32, block_size=48)
    with pytest.raises(ValueError, match=r"\[64, 64\]"):
        gptq_quantize(w, torch.eye(32), 32)
    with pytest.raises(ValueError, match=r"one of \(32, 64, 128\)"):
        gptq_quantize(w, h, 16)
    with pytest.raises(ValueError, match="calibration_token_ids are needed"):
        quantize_model(tiny_llama(), "gptq", 32)


def model_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, torch.arange(ids.shape[1]).expand_as(ids), last_only=False)


def test_gptq_model_is_int4_and_closer_to_float_than_round_to_nearest():
    ids = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(6))  # 8 windows of its 64 positions
    reference = model_logits(tiny_model(), ids)
    errors = {}
    for method in ("int4", "gptq"):
        model = tiny_model()
        calibration = ids.flatten().tolist() if method == "gptq" else None
        quantize_model(model, method, 32, backend="reference", head=None, calibration_token_ids=calibration,
                       gptq_after_awq=False, gptq_desc_act=False)
        assert all(isinstance(layer.mlp.down_proj, Int4Linear) for layer in model.layers)
        errors[method] = (model_logits(model, ids) - reference).pow(2).mean().item()
    assert errors["gptq"] < 0.7 * errors["int4"]


def test_each_layer_is_calibrated_on_the_quantized_layers_before_it():
    model, ids = tiny_model(), torch.randint(0, 64, (256,), generator=torch.Generator().manual_seed(7)).tolist()
    codes = apply_gptq(model, ids, 32, window=64)
    assert sorted(codes) == sorted((i, name) for i in range(3) for name in
                                   ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    # the float weights now hold exactly what the codes stand for, so later layers saw int4 activations
    packed, scale, minimum = codes[0, "down_proj"]
    assert torch.equal(model.layers[0].mlp.down_proj.weight, dequantize_int4(packed, scale, minimum))



def captured_hessians(sequential: bool) -> dict[str, torch.Tensor]:
    """The Hessian each matrix of layer 0 of tiny_model is quantized for (apply_gptq, groups of 32)."""
    import minfer.quant.gptq as gptq

    hessians, real = {}, gptq.gptq_quantize

    def spy(w, hessian, *args):
        hessians[len(hessians)] = hessian.clone()
        return real(w, hessian, *args)

    ids = torch.randint(0, 64, (128,), generator=torch.Generator().manual_seed(8)).tolist()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gptq, "gptq_quantize", spy)
        apply_gptq(tiny_model(), ids, 32, window=64, sequential=sequential)
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # layer 0's, in the order they run
    return {name: hessians[k] for k, name in enumerate(names)}


def test_true_sequential_recomputes_each_input_after_the_matrices_before_it():
    sequential, one_pass = captured_hessians(True), captured_hessians(False)
    # qkv_proj reads the layer's input, which no matrix of this layer touches: the same either way
    assert torch.equal(sequential["qkv_proj"], one_pass["qkv_proj"])
    # every later matrix reads activations that the already quantized ones before it changed
    for name in ("o_proj", "gate_up_proj", "down_proj"):
        assert not torch.allclose(sequential[name], one_pass[name], rtol=1e-4, atol=1e-6), name


def fp8_output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    return (x @ (w.double() - dequantize_fp8_rows(q, scale).double()).T.float()).pow(2).mean().item()


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_on_the_fp8_grid_keeps_the_format_and_beats_round_to_nearest(desc_act):
    """The same column loop on e4m3's grid: codes are e4m3 with round-to-nearest's row scales, and the output
    error on the calibration inputs is far lower."""
    x = correlated_inputs()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    q_rtn, scale_rtn = quantize_fp8_rows(w)
    q, scale = gptq_quantize_fp8(w, input_hessian(x), desc_act=desc_act)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and torch.equal(scale, scale_rtn)
    assert fp8_output_error(x, w, q, scale) < 0.5 * fp8_output_error(x, w, q_rtn, scale_rtn)
    with pytest.raises(ValueError, match="Hessian must be"):
        gptq_quantize_fp8(w, torch.eye(32))


def test_gptq_fp8_model_loads_as_fp8_layers_and_is_closer_to_float_than_fp8():
    ids = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(6))
    reference = model_logits(tiny_model(), ids)
    errors = {}
    for method in ("fp8", "gptq_fp8"):
        model = tiny_model()
        calibration = ids.flatten().tolist() if method == "gptq_fp8" else None
        quantize_model(model, method, backend="reference", head=None, calibration_token_ids=calibration)
        assert all(isinstance(layer.mlp.down_proj, Fp8Linear) for layer in model.layers)
        errors[method] = (model_logits(model, ids) - reference).pow(2).mean().item()
    assert errors["gptq_fp8"] < 0.7 * errors["fp8"]
