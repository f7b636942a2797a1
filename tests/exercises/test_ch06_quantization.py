"""Chapter 06: int8 per channel, int4 in packed groups, int8 KV entries: error bounds and exact formats.

The formats are checked against minfer's own (minfer.formats.weights), so a learner's int4 codes
are the ones the engine's kernels would read.
"""
import pytest
import torch

from minfer.formats import weights as engine_format


def layer_like(out_features: int = 24, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    """Small Gaussian weights with a few large outliers, like a real layer's."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    w[torch.rand(w.shape, generator=gen) < 0.02] *= 15
    return w


# ----------------------------------------------------------------- int8 per channel

def test_int8_codes_and_scales(impl):
    w = layer_like()
    q, scale = impl.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.shape == (w.shape[0],)
    torch.testing.assert_close(scale.float(), w.abs().amax(dim=1) / 127)
    assert (q.abs().amax(dim=1) == 127).all()  # each row's largest weight uses the whole range


def test_int8_error_is_at_most_half_a_step(impl):
    w = layer_like(seed=1)
    q, scale = impl.quantize_int8_per_channel(w)
    error = (impl.dequantize_int8(q, scale) - w).abs()
    assert (error <= scale.float()[:, None] / 2 + 1e-7).all()


def test_int8_zero_row(impl):
    w = layer_like()
    w[5] = 0
    q, scale = impl.quantize_int8_per_channel(w)
    assert scale[5] == 0 and (q[5] == 0).all()
    assert not impl.dequantize_int8(q, scale).isnan().any()


def test_int8_per_channel_beats_one_scale_for_the_whole_matrix(impl):
    w = layer_like()
    w[0] *= 50  # one loud row would stretch a shared grid for every other row
    q, scale = impl.quantize_int8_per_channel(w)
    per_channel = (impl.dequantize_int8(q, scale) - w).abs().mean()
    one_scale = w.abs().max() / 127
    whole = (torch.round(w / one_scale) * one_scale - w).abs().mean()
    assert per_channel < whole / 5


# ----------------------------------------------------------------- int4 in groups

@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groups_match_the_engines_format(impl, group_size):
    w = layer_like(seed=group_size)
    q, scale, minimum = impl.quantize_int4_groupwise(w, group_size)
    assert q.dtype == torch.uint8 and q.shape == w.shape and int(q.max()) <= 15
    assert scale.shape == minimum.shape == (w.shape[0], w.shape[1] // group_size)
    groups = w.reshape(w.shape[0], -1, group_size)
    torch.testing.assert_close(minimum.float(), groups.amin(dim=-1))
    torch.testing.assert_close(scale.float(), (groups.amax(dim=-1) - groups.amin(dim=-1)) / 15)
    # minfer stores float16 scales; with the same (rounded) grid the codes must agree almost everywhere
    q_engine, _, _ = engine_format.quantize_int4_groupwise(w, group_size)
    assert (q.long() - q_engine.long()).abs().max() <= 1 and (q == q_engine).float().mean() > 0.97


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_bound(impl, group_size):
    w = layer_like(seed=3)
    q, scale, minimum = impl.quantize_int4_groupwise(w, group_size)
    rebuilt = impl.dequantize_int4(impl.pack_int4(q), scale, minimum, group_size)
    assert rebuilt.shape == w.shape
    step = scale.float().repeat_interleave(group_size, dim=1)
    assert ((rebuilt - w).abs() <= step / 2 + 1e-6).all()


def test_int4_constant_group_and_bad_group_size(impl):
    w = layer_like()
    w[2, :32] = -0.3
    q, scale, minimum = impl.quantize_int4_groupwise(w, 32)
    assert scale[2, 0] == 0 and (q[2, :32] == 0).all()
    rebuilt = impl.dequantize_int4(impl.pack_int4(q), scale, minimum, 32)
    torch.testing.assert_close(rebuilt[2, :32], w[2, :32])
    with pytest.raises(ValueError):
        impl.quantize_int4_groupwise(layer_like(in_features=96), 64)


def test_pack_unpack(impl):
    q = torch.randint(0, 16, (5, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    packed = impl.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 20)
    assert torch.equal(packed, engine_format.pack_int4(q))  # low nibble: column 2i; high: 2i + 1
    assert torch.equal(impl.unpack_int4(packed), q)


def test_smaller_groups_fit_better(impl):
    w = layer_like(seed=4)
    errors = []
    for group_size in (32, 64, 128):
        q, scale, minimum = impl.quantize_int4_groupwise(w, group_size)
        errors.append((impl.dequantize_int4(impl.pack_int4(q), scale, minimum, group_size) - w).abs().mean())
    assert errors[0] < errors[1] < errors[2]


# ----------------------------------------------------------------- int8 KV entries

def test_kv_int8_scales_per_token_and_head(impl):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 3, 16, generator=gen) * torch.linspace(0.1, 10, 7)[:, None, None]  # tokens differ in size
    q, scale = impl.quantize_kv_int8(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == (7, 3)
    torch.testing.assert_close(scale.float(), x.abs().amax(dim=-1) / 127)
    error = (impl.dequantize_kv_int8(q, scale) - x).abs()
    assert (error <= scale.float()[..., None] / 2 + 1e-6).all()


def test_kv_int8_new_token_leaves_old_ones_alone(impl):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 2, 8, generator=gen)
    q, scale = impl.quantize_kv_int8(x)
    bigger = torch.cat([x, 100 * torch.randn(1, 2, 8, generator=gen)])  # a loud new token arrives
    q2, scale2 = impl.quantize_kv_int8(bigger)
    assert torch.equal(q2[:4], q) and torch.equal(scale2[:4], scale)


def test_kv_int8_zero_vector(impl):
    x = torch.zeros(2, 2, 8)
    x[1, 1] = 1.0
    q, scale = impl.quantize_kv_int8(x)
    assert scale[0, 0] == 0 and (q[0, 0] == 0).all()
    torch.testing.assert_close(impl.dequantize_kv_int8(q, scale), x)
