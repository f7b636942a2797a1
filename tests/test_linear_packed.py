"""CPU linears with prepacked weights: the same numbers as F.linear, repacked when the weight changes."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minfer.lab.bench.common import best_time
from minfer.layers import linear as linear_module
from minfer.layers.linear import (WIDE_FROM_ROWS, PackedLinear, bf16_autocast, pack_linears, packed_dtype, packs_here,
                                 unpack_linears)
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
    """bfloat16 packing needs AVX-512 or AVX-NE-CONVERT: where oneDNN refuses it, a bfloat16 layer is packed in float32."""
    assert packs_here(torch.float32)
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 4, dtype=torch.bfloat16), 1)
        accepted = True
    except RuntimeError:
        accepted = False
    assert packs_here(torch.bfloat16) == accepted
    assert packed_dtype(torch.bfloat16) == (torch.bfloat16 if accepted else torch.float32)
    model = pack_linears(nn.Sequential(nn.Linear(16, 8)).to(torch.bfloat16))
    assert type(model[0]) is PackedLinear
    with torch.inference_mode():
        assert model(torch.randn(3, 16, dtype=torch.bfloat16)).shape == (3, 8)
    assert model[0]._packed_dtype == packed_dtype(torch.bfloat16)


@pytest.fixture
def no_bf16_packing(monkeypatch):
    """This CPU as an AVX2-only one: oneDNN packs float32 only."""
    monkeypatch.setattr(linear_module, "packs_here", lambda dtype: dtype == torch.float32)


def count_f_linear(monkeypatch) -> list:
    calls = []
    plain = F.linear
    monkeypatch.setattr(linear_module.F, "linear", lambda *args: calls.append(args[0].shape) or plain(*args))
    return calls


@pytest.mark.parametrize("bias", [True, False])
def test_bfloat16_without_bf16_packing_uses_a_float32_copy_from_enough_rows(no_bf16_packing, monkeypatch, bias):
    """Fewer than WIDE_FROM_ROWS rows: F.linear on the bfloat16 weight (half the bytes); from there on, the float32
    packed copy, which must give F.linear's bfloat16 result (both sum in float32) up to one bfloat16 rounding."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    packed = pack_linears(nn.Sequential(copy.deepcopy(layer)))[0]
    calls = count_f_linear(monkeypatch)
    with torch.inference_mode():
        for rows in (1, WIDE_FROM_ROWS - 1, WIDE_FROM_ROWS, 3 * WIDE_FROM_ROWS):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            expected = layer(x)
            out = packed(x)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1.6e-2)
    assert packed._packed_dtype == torch.float32 and packed._packed is not None
    # the two small calls went to F.linear (besides the reference's own four); the two large ones did not
    assert [shape[0] for shape in calls] == [1, 1, WIDE_FROM_ROWS - 1, WIDE_FROM_ROWS - 1, WIDE_FROM_ROWS,
                                             3 * WIDE_FROM_ROWS]


@pytest.mark.skipif(packs_here(torch.bfloat16), reason="this CPU packs bfloat16 itself: no float32 copy to time")
def test_float32_copy_is_faster_than_f_linear_for_bfloat16_batches():
    """Where the float32 copy is used (no bf16 instructions), it must pay: 64 rows through 8 matrices of the model's
    shapes ran 4-6x faster than F.linear's bfloat16 path on an AVX2 Zen 3 core; asserted: more than 1.5x."""
    torch.manual_seed(0)
    layers = [nn.Linear(576, 1536, bias=False).to(torch.bfloat16) for _ in range(8)]
    packed = [pack_linears(nn.Sequential(copy.deepcopy(layer)))[0] for layer in layers]
    x = torch.randn(64, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        plain_s = best_time(lambda: [layer(x) for layer in layers], repeats=3)
        packed_s = best_time(lambda: [layer(x) for layer in packed], repeats=3)
    assert plain_s / packed_s > 1.5, f"float32 copy {packed_s * 1e3:.1f} ms vs F.linear {plain_s * 1e3:.1f} ms"


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
    """A packed float32 model converted with .to(dtype) repacks (bfloat16: in float32 where oneDNN cannot pack it),
    else runs F.linear (float16 on most CPUs) instead of failing."""
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


@pytest.mark.parametrize("cpu_packs_bf16", [True, False])
def test_bf16_autocast_only_where_bfloat16_matmuls_are_fast(monkeypatch, cpu_packs_bf16):
    """Training's bf16 autocast: bfloat16 matmuls on a CPU oneDNN packs bfloat16 for, float32 on an AVX2-only one."""
    monkeypatch.setattr(linear_module, "packs_here", lambda dtype: cpu_packs_bf16 or dtype == torch.float32)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with bf16_autocast("cpu"):
        assert (a @ b).dtype == (torch.bfloat16 if cpu_packs_bf16 else torch.float32)
    with bf16_autocast("cpu", enabled=False):
        assert (a @ b).dtype == torch.float32


def test_unpack_linears_gives_plain_layers_on_the_same_parameters():
    torch.manual_seed(0)
    model = pack_linears(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4, bias=False)))
    weights = [m.weight for m in model]
    x = torch.randn(3, 16)
    expected = model(x)
    unpack_linears(model)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]
    assert all(m.weight is w for m, w in zip(model, weights))
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
