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


FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not FP8_GPU, reason="W8A8 through torch._scaled_mm needs a CUDA GPU from sm_89 on")
def test_w8a8_on_the_gpu_at_decode_row_counts_and_under_cuda_graphs(tiny_dir):
    """On the GPU (benchmarks/gpu_check.sh): _scaled_mm at the row counts decode steps give it (one row, odd
    counts, a CUDA-graph bucket's padding), then the engine's graphed steps against eager ones."""
    from minfer import LLM, SamplingParams

    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(576, 1536, bias=False).to("cuda", torch.bfloat16)
    layer = Fp8Linear.from_linear(linear, "torch")
    for rows in (1, 3, 16, 17):
        x = torch.randn(rows, 576, generator=gen).to("cuda", torch.bfloat16)
        exact = nn.functional.linear(x.float(), layer.dequantize())
        assert ((layer(x).float() - exact).norm() / exact.norm()).item() < 0.05, rows
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(5)]
    runs = []
    for eager in (True, None):
        llm = LLM(tiny_dir, quantization="fp8", dtype="bfloat16", device="cuda", enforce_eager=eager)
        with torch.no_grad():
            llm.model.norm.weight.mul_(30)  # a clear argmax: a graph's padded rows may round a near tie differently
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)])
    graphs = llm.engine.runner.decode_step
    assert graphs is not None and graphs.failed is None and graphs.replays, graphs
    assert runs[0] == runs[1]
