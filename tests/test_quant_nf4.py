"""NF4 (minfer/formats/nf4.py, minfer/quant/nf4.py): QLoRA's table, the round-trip bound, the layer, bad arguments,
its checkpoint."""
import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.formats.nf4 import NF4_LEVELS, dequantize_nf4, nf4_levels, quantize_nf4, round_to_nf4
from minfer.quant import linear_weight_bytes, quantize_model
from minfer.quant.checkpoint import save_quantized
from minfer.quant.nf4 import Nf4Linear

# The table as published with QLoRA (Dettmers et al., 2023, appendix E; bitsandbytes' NF4 code book)
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.2461123913526535, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def normal_weights(out_features=32, in_features=256, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen) * 0.05


def test_levels_are_the_published_nf4_table():
    torch.testing.assert_close(nf4_levels(), torch.tensor(PUBLISHED_NF4), rtol=0, atol=1e-6)
    assert NF4_LEVELS[7] == 0 and NF4_LEVELS[0] == -1 and NF4_LEVELS[15] == 1  # zero exact, span [-1, 1]


def test_rounding_picks_the_nearest_level():
    x = torch.linspace(-1, 1, 1001)
    nearest = (x[:, None] - NF4_LEVELS[None]).abs().argmin(dim=1)
    assert torch.equal(round_to_nf4(x).long(), nearest)


@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_round_trip_within_half_the_widest_gap(block_size):
    w = normal_weights()
    packed, absmax = quantize_nf4(w, block_size)
    assert packed.dtype == torch.uint8 and packed.shape == (32, 128)
    assert absmax.dtype == torch.float16 and absmax.shape == (32, 256 // block_size)
    per_weight = absmax.float().repeat_interleave(block_size, dim=1)
    torch.testing.assert_close(per_weight.reshape(32, -1, block_size)[..., 0],
                               w.abs().reshape(32, -1, block_size).amax(-1), rtol=1e-3, atol=0)
    half_gap = (NF4_LEVELS[1:] - NF4_LEVELS[:-1]).max() / 2
    error = (dequantize_nf4(packed, absmax) - w).abs()
    assert (error <= per_weight * (half_gap + 1e-3)).all()
    assert error.max() > per_weight.max() * half_gap * 0.5  # the bound is not vacuous


def test_zero_block_and_exact_levels_round_trip():
    w = normal_weights(4, 128)
    w[1, :64] = 0
    w[2, :64] = NF4_LEVELS.repeat(4) * 0.5  # the levels themselves, absmax 0.5: exactly representable
    out = dequantize_nf4(*quantize_nf4(w, 64))
    assert (out[1, :64] == 0).all() and not out.isnan().any()
    torch.testing.assert_close(out[2, :64], w[2, :64])


def test_nf4_beats_evenly_spaced_levels_with_the_same_absmax():
    w = normal_weights(64, 512, seed=3)
    nf4 = (dequantize_nf4(*quantize_nf4(w, 64)) - w).norm()
    blocks = w.reshape(64, -1, 64)
    absmax = blocks.abs().amax(-1, keepdim=True)
    even = torch.linspace(-1, 1, 16)
    nearest = even[(blocks[..., None] / absmax[..., None] - even).abs().argmin(-1)] * absmax
    assert nf4 < 0.95 * (nearest.reshape(w.shape) - w).norm()  # levels where normal weights are dense


@pytest.mark.parametrize("call, message", [
    (lambda: quantize_nf4(torch.zeros(4, 100), 64), "not divisible"),
    (lambda: quantize_nf4(torch.zeros(4, 128), 48), "block_size must be one of"),
    (lambda: quantize_nf4(torch.zeros(128), 64), "2-D"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_nf4_model_matches_its_dequantized_weights(tiny_dir):
    float_llm = LLM(tiny_dir, dtype="float32")
    llm = LLM(tiny_dir, dtype="float32", quantization="nf4", quantization_group_size=32)
    layer = llm.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, Nf4Linear) and layer.block_size == 32
    x = torch.randn(3, layer.in_features)
    torch.testing.assert_close(layer(x), x @ layer.dequantize().T + (0 if layer.bias is None else layer.bias))
    reference = float_llm.model.layers[0].self_attn.qkv_proj.weight
    assert (layer.dequantize() - reference).norm() < 0.2 * reference.norm()
    assert linear_weight_bytes(llm.model) < linear_weight_bytes(float_llm.model, torch.bfloat16) / 3.5
    out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_nf4_bad_arguments(tiny_dir):
    with pytest.raises(ValueError, match="group_size must be one of"):
        LLM(tiny_dir, quantization="nf4", quantization_group_size=48)


def test_nf4_checkpoint_loads_to_identical_logits(tiny_dir, tmp_path):
    from minfer.models.loader import load_model
    from minfer.quant.checkpoint import build_quantized_model

    llm = LLM(tiny_dir, dtype="float32", quantization="nf4", quantization_group_size=32)
    save_quantized(llm, str(tmp_path / "nf4"))
    reloaded = build_quantized_model(load_model(str(tmp_path / "nf4")))
    layer = reloaded.layers[1].mlp.down_proj
    assert isinstance(layer, Nf4Linear) and layer.block_size == 32
    ids = torch.arange(3, 40)[None]
    positions = torch.arange(ids.shape[1])[None]
    expected = llm.model(ids, positions, last_only=False)
    assert torch.equal(reloaded(ids, positions, last_only=False), expected)
    assert LLM(str(tmp_path / "nf4")).model.quantization == llm.model.quantization
