"""CPU linears with prepacked weights: the same numbers as F.linear, repacked when the weight changes."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minfer.layers.linear import PackedLinear, pack_linears, packs_here
from minfer.quant.linear import Int8Linear


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])  # one bfloat16 step; measured identical here
def test_packed_equals_f_linear(dtype, tolerance):
    if not packs_here(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU ({torch.backends.cpu.get_cpu_capability()})")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 32, bias=False)).to(dtype)
    x = torch.randn(5, 7, 64, dtype=dtype)
    expected = model(x)
    pack_linears(model)
    assert all(type(m) is PackedLinear for m in model)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=tolerance, atol=tolerance)


def test_packs_here_tells_what_onednn_accepts():
    """bfloat16 packing needs AVX-512 or AVX-NE-CONVERT: where oneDNN refuses it, the layers stay nn.Linear."""
    assert packs_here(torch.float32)
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 4, dtype=torch.bfloat16), 1)
        accepted = True
    except RuntimeError:
        accepted = False
    assert packs_here(torch.bfloat16) == accepted
    model = pack_linears(nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16))
    assert (type(model[0]) is PackedLinear) == accepted
    with torch.inference_mode():
        assert model(torch.randn(3, 16, dtype=torch.bfloat16)).shape == (3, 8)  # runs either way


def test_in_place_change_repacks_and_ties_survive():
    torch.manual_seed(0)
    embed = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embed, "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = embed.weight  # tied, as SmolLM2's head is
    pack_linears(model)
    assert model["head"].weight is embed.weight
    x = torch.randn(3, 16)
    before = model["head"](x)
    with torch.no_grad():
        embed.weight.mul_(2)  # e.g. scales folded into the weights after loading
    torch.testing.assert_close(model["head"](x), 2 * before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_model_moved_to_another_dtype_still_runs(dtype):
    """A packed float32 model converted with .to(dtype) repacks if oneDNN can pack dtype here, else runs F.linear
    (float16 on most CPUs, bfloat16 on AVX2-only ones) instead of failing."""
    torch.manual_seed(0)
    model = pack_linears(nn.Sequential(nn.Linear(32, 16)))
    x = torch.randn(3, 32)
    with torch.inference_mode():
        model(x)  # packed in float32
        model.to(dtype)
        expected = F.linear(x.to(dtype), model[0].weight, model[0].bias)
        torch.testing.assert_close(model(x.to(dtype)), expected, rtol=1.6e-2, atol=1.6e-2)


def test_deepcopy_repacks_in_the_copy():
    model = pack_linears(nn.Sequential(nn.Linear(16, 8)))
    x = torch.randn(2, 16)
    expected = model(x)  # packs
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(x), expected)
    assert twin[0]._packed is not model[0]._packed


def test_quantized_layers_are_left_alone():
    model = nn.Sequential(Int8Linear.from_linear(nn.Linear(32, 16)), nn.Linear(16, 8).to(torch.float16))
    pack_linears(model)
    assert type(model[0]) is Int8Linear and type(model[1]) is nn.Linear  # float16: oneDNN cannot pack it here
