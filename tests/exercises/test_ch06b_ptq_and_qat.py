"""Chapter 06b: the GPTQ column update and GPTQ on a small matrix, NF4 against QLoRA's table and minfer's
format, and a fake-quant layer whose straight-through gradient autograd checks."""
import pytest
import torch

from minfer.formats import nf4 as engine_nf4
from minfer.formats.weights import unpack_int4
from minfer.quant import awq as engine_awq
from minfer.quant import gptq as engine_gptq

PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.2461123913526535, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def correlated_inputs(tokens=512, features=64, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    factors = torch.randn(tokens, 8, generator=gen)
    return factors @ torch.randn(8, features, generator=gen) + 0.1 * torch.randn(tokens, features, generator=gen)


def weights(out_features=16, in_features=64, seed=1) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05


# ----------------------------------------------------------------- GPTQ

def test_inverse_hessian_cholesky(impl):
    x = correlated_inputs().double()
    h = 2 * x.T @ x / len(x)
    u = impl.inverse_hessian_cholesky(h, damping=0.01)
    assert torch.allclose(u, torch.triu(u))  # upper triangular
    dampened = h + 0.01 * h.diagonal().mean() * torch.eye(64, dtype=h.dtype)
    torch.testing.assert_close(u.T @ u, torch.linalg.inv(dampened))
    torch.testing.assert_close(u, engine_gptq.inverse_hessian_cholesky(h, 0.01))


def test_one_column_update_is_the_optimal_brain_surgeon_step(impl):
    x = correlated_inputs().double()
    h = 2 * x.T @ x / len(x)
    u = engine_gptq.inverse_hessian_cholesky(h, 0.01)
    w = weights().double()
    rounded = torch.round(w[:, 0] * 20) / 20
    out = impl.gptq_column_update(w, u, 0, rounded)
    assert torch.equal(out[:, 0], rounded) and not torch.equal(out, w)
    # the textbook step with the full inverse: w_F -= e / [H^-1]_00 * [H^-1]_{0,F}
    hinv = u.T @ u
    expected = w.clone()
    expected[:, 1:] -= ((w[:, 0] - rounded) / hinv[0, 0])[:, None] * hinv[0, 1:][None]
    expected[:, 0] = rounded
    torch.testing.assert_close(out, expected)
    # it is the best the other columns can do: the output error is lower than leaving them alone
    leave = w.clone()
    leave[:, 0] = rounded
    error = lambda v: ((w - v) @ h @ (w - v).T).trace()
    assert error(out) < error(leave)


def test_gptq_on_a_small_matrix_beats_round_to_nearest_and_matches_minfer(impl):
    x = correlated_inputs()
    h = engine_gptq.input_hessian(x)
    w = weights()
    ours = impl.gptq_quantize(w, h, 32)
    output_error = lambda v: (x @ (w - v).T).pow(2).mean().item()
    rtn = engine_awq.fake_quantize_int4(w, 32)
    assert output_error(ours) < 0.7 * output_error(rtn)
    q, scale, minimum = engine_gptq.gptq_quantize(w, h, 32)
    engine = (q.float().reshape(16, -1, 32) * scale.float()[..., None] + minimum.float()[..., None]).reshape(16, 64)
    assert output_error(ours) < 1.1 * output_error(engine)  # minfer's grids are float16: a little apart
    # every column of the result lies on its group's grid: at most 16 distinct values per row and group
    assert all(len(torch.unique(ours[r, g * 32:(g + 1) * 32])) <= 16 for r in range(16) for g in range(2))


# ----------------------------------------------------------------- NF4

def test_nf4_levels_are_qloras(impl):
    levels = impl.nf4_levels()
    torch.testing.assert_close(levels.float(), torch.tensor(PUBLISHED_NF4), rtol=0, atol=1e-6)


def test_nf4_codes_match_minfers_format(impl):
    w = weights(8, 128, seed=2)
    w[3, :64] = 0
    codes, absmax = impl.quantize_nf4(w, 64)
    assert codes.dtype == torch.uint8 and codes.shape == w.shape and absmax.shape == (8, 2)
    packed, engine_absmax = engine_nf4.quantize_nf4(w, 64)
    assert (codes != unpack_int4(packed)).float().mean() < 0.01  # minfer rounds against a float16 absmax
    torch.testing.assert_close(absmax.float(), engine_absmax.float(), rtol=1e-3, atol=0)
    out = impl.dequantize_nf4(codes, absmax, 64)
    assert (out[3, :64] == 0).all() and not out.isnan().any()
    half_gap = (engine_nf4.NF4_LEVELS[1:] - engine_nf4.NF4_LEVELS[:-1]).max() / 2
    assert ((out - w).abs() <= absmax.repeat_interleave(64, dim=1) * half_gap + 1e-7).all()


def test_nf4_bad_block_size(impl):
    with pytest.raises(ValueError):
        impl.quantize_nf4(torch.zeros(4, 100), 64)


# ----------------------------------------------------------------- fake quantization, straight through

def test_fake_quantize_is_minfers_int4_grid(impl):
    w = weights(8, 128, seed=3)
    ours, engine = impl.fake_quantize_int4(w, 64), engine_awq.fake_quantize_int4(w, 64)
    step = (w.amax() - w.amin()).item() / 15
    close = (ours - engine).abs() < 0.01 * step  # minfer stores scale and minimum in float16, which can
    assert close.float().mean() > 0.99           # move a weight sitting on a rounding boundary by one step
    assert ((ours - w).abs() <= w.abs().max() / 15 + 1e-6).all()


def test_straight_through_value_and_gradient(impl):
    w = weights(8, 128, seed=4).requires_grad_(True)
    out = impl.straight_through(w, 64)
    torch.testing.assert_close(out, impl.fake_quantize_int4(w.detach(), 64))
    target = torch.randn(8, 128, generator=torch.Generator().manual_seed(5))
    (out * target).sum().backward()
    torch.testing.assert_close(w.grad, target)  # the identity's gradient, not rounding's zero


def test_fake_quant_layer_gradient_checked_with_autograd(impl):
    w = weights(8, 64, seed=6)
    layer = impl.FakeQuantLinear(w, 32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    y = layer(x)
    rounded = impl.fake_quantize_int4(w, 32).requires_grad_(True)
    torch.testing.assert_close(y, x @ rounded.T)
    y.square().sum().backward()
    (x @ rounded.T).square().sum().backward()
    # straight through: the float weight gets exactly the gradient the rounded weight would get
    torch.testing.assert_close(layer.weight.grad, rounded.grad)
    assert layer.weight.grad.abs().sum() > 0
