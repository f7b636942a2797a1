"""fp8 (e4m3) weights: the row format, the layer's two matmuls, which one runs where, and the engine option."""
from unittest import mock

import pytest
import torch
from torch import nn

from minfer.formats.fp8 import dequantize_fp8_rows, quantize_fp8_rows
from minfer.formats.kv import FP8_MAX
from minfer.quant.fp8_linear import Fp8Linear, fp8_backend


def test_rows_keep_every_normal_value_within_one_sixteenth_and_zero_rows_exact():
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 8)[:, None]
    x[3] = 0
    q, scale = quantize_fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (8, 1)
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 2, 4, 5, 6, 7]], torch.full((7,), FP8_MAX))
    back = dequantize_fp8_rows(q, scale)
    normal = x.abs() >= scale * 2 ** -6  # e4m3's smallest normal number, scaled
    assert ((back - x).abs() <= x.abs() / 16)[normal].all()  # 3 mantissa bits: half a step is 1/16 at worst
    assert torch.equal(back[3], torch.zeros(256)) and scale[3].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_matmuls_follow_the_float_layer(dtype):
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(128, 96, bias=True)
    x = torch.randn(2, 5, 128, generator=gen)
    exact = linear(x)
    linear.to(dtype)
    for backend in ("reference", "torch"):
        out = Fp8Linear.from_linear(linear, backend)(x.to(dtype))
        assert out.shape == (2, 5, 96) and out.dtype == dtype
        error = (out.float() - exact).norm() / exact.norm()
        assert error < 0.05, (backend, error)  # measured about 0.02 (W8A16) and 0.03 (W8A8): e4m3's rounding
    assert torch.equal(Fp8Linear.from_linear(linear, "reference").dequantize(),
                       dequantize_fp8_rows(*quantize_fp8_rows(linear.weight.detach())))


def test_which_matmul_runs_where():
    cpu = torch.device("cpu")
    assert fp8_backend("auto", cpu) == "reference" and fp8_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="no Triton kernel"):
        fp8_backend("triton", cpu)
    gpu = torch.device("cuda", 0)
    for capability, auto in (((9, 0), "torch"), ((8, 9), "torch"), ((8, 6), "reference"), ((7, 5), "reference")):
        with mock.patch("minfer.quant.fp8_linear.cuda_capability", return_value=capability):
            assert fp8_backend("auto", gpu) == auto
            assert fp8_backend("reference", gpu) == "reference"
            if auto == "reference":
                with pytest.raises(ValueError, match=rf"8\.9 or newer; this one is sm_{capability[0]}{capability[1]}"):
                    fp8_backend("torch", gpu)


def test_the_engine_option_and_a_checkpoint_round_trip(tiny_dir, tmp_path):
    from minfer import LLM, SamplingParams
    from minfer.quant.checkpoint import quantize_checkpoint

    llm = LLM(tiny_dir, quantization="fp8", dtype="float32", device="cpu")
    assert isinstance(llm.model.layers[0].mlp.down_proj, Fp8Linear)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    saved = quantize_checkpoint(tiny_dir, "fp8", str(tmp_path / "fp8"))
    loaded = LLM(saved, dtype="float32", device="cpu")
    assert loaded.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy, use_tqdm=False)[0].outputs[0].token_ids == tokens
    with pytest.raises(ValueError, match="group size|group_size"):
        LLM(tiny_dir, quantization="fp8", quantization_group_size=64, device="cpu")
