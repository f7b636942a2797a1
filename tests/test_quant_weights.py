"""Weight quantization: the formats' error bounds, the fast paths and kernels against the reference,
quantized models against unquantized ones, and the GGUF Q4_1 file read as our int4 g32.

The Triton kernels run interpreted (TRITON_INTERPRET=1), on small shapes, in a fresh process: so they are
interpreted on a GPU machine too, whose test process compiles (tests/test_kernel_compile.py runs them compiled).
"""
import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.config import allowed_group_sizes
from minfer.kernels.quant_matmul import int4_matmul_reference, int8_matmul_reference
from minfer.models.loader import resolve_model_path
from minfer.quant import linear_weight_bytes, model_weight_bytes, quantize_model
from minfer.quant.gguf_q4_1 import q4_1_block, read_q4_1, requantize_agreement
from minfer.quant.linear import Int4Linear, Int8Linear
from minfer.quant.torch_ops import (INT8_DENSE_FROM_ROWS, dequantize_int4_cpu, int4_mm_cpu, int8_mm_cpu,
                                    pack_int4_for_cpu)
from minfer.formats.weights import (dequantize_int4, dequantize_int8, pack_int4, quantize_int4_groupwise,
                                  quantize_int8_per_channel, unpack_int4)
from minfer.lab.testing import random_checkpoint

REPO = Path(__file__).resolve().parents[1]


def weights(out_features=48, in_features=256, seed=0) -> torch.Tensor:
    """Gaussian weights with a few large outliers, as real layers have."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    w[torch.rand(w.shape, generator=gen) < 0.01] *= 20
    return w


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


# --- the formats ------------------------------------------------------------------------------------
def test_int8_per_channel_error_is_at_most_half_a_step():
    w = weights()
    w[3] = 0.0  # an all-zero row must survive (scale 0)
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (w.shape[0],)
    assert q.abs().max() <= 127 and (q.abs().amax(dim=1)[scale > 0] == 127).all()  # every row uses its full range
    error = (dequantize_int8(q, scale) - w).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()
    assert (dequantize_int8(q, scale)[3] == 0).all()


def test_int4_pack_unpack_is_exact():
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert packed[0, 0] == q[0, 0] | (q[0, 1] << 4)  # column 2i low nibble, 2i+1 high
    with pytest.raises(ValueError, match="even"):
        pack_int4(q[:, :3])


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groupwise_error_bound(group_size):
    w = weights()
    w[0, :group_size] = 0.25  # a constant group comes back exactly
    q, scale, minimum = quantize_int4_groupwise(w, group_size)
    assert q.max() <= 15 and scale.dtype == minimum.dtype == torch.float16
    assert scale.shape == minimum.shape == (w.shape[0], w.shape[1] // group_size)
    rebuilt = dequantize_int4(pack_int4(q), scale, minimum)
    step = scale.float().repeat_interleave(group_size, dim=1)
    assert ((rebuilt - w).abs() <= step / 2 * 1.01 + 1e-6).all()
    assert (rebuilt[0, :group_size] == 0.25).all()
    # Smaller groups fit their grids better: the mean error shrinks with the group size.
    if group_size > 32:
        q32, s32, m32 = quantize_int4_groupwise(w, 32)
        assert (dequantize_int4(pack_int4(q32), s32, m32) - w).abs().mean() < (rebuilt - w).abs().mean()


def test_bad_group_sizes():
    with pytest.raises(ValueError, match="one of"):
        quantize_int4_groupwise(weights(), 48)
    with pytest.raises(ValueError, match="not divisible"):
        quantize_int4_groupwise(weights(in_features=96), 64)


# --- PyTorch's CPU kernels against the reference -----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int8_kernel_matches_reference(dtype):
    w, x = weights(), torch.randn(5, 256).to(dtype)
    q, scale = quantize_int8_per_channel(w)
    expected = int8_matmul_reference(x, q, scale).float()
    out = int8_mm_cpu(x, q, scale)
    assert relative_error(out, expected) < 1e-2  # the kernel runs on bfloat16 activations
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int8_goes_dense_from_enough_rows(dtype):
    """Below INT8_DENSE_FROM_ROWS rows the kernel (bfloat16 activations); from there on the dequantized
    matrix in a float32 matmul, as exact as the float32 reference."""
    w = weights()
    q, scale = quantize_int8_per_channel(w)
    half = INT8_DENSE_FROM_ROWS // 2  # [2, half - 1, K] is two rows short of the threshold, [2, half, K] at it
    few, many = (torch.randn(2, rows, 256).to(dtype) for rows in (half - 1, half))
    for x, dense in [(few, False), (many, True)]:
        out = int8_mm_cpu(x, q, scale)
        assert out.shape == (2, x.shape[1], 48) and out.dtype == dtype
        error = relative_error(out.float(), int8_matmul_reference(x.float(), q, scale))
        if dtype == torch.float32:
            assert (error < 1e-6) == dense, (x.shape, error)  # the kernel's bfloat16 activations err ~1e-3
        else:
            assert error < 1e-2


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4_kernel_matches_reference(group_size, dtype):
    w, x = weights(), torch.randn(2, 3, 256).to(dtype)
    q, scale, minimum = quantize_int4_groupwise(w, group_size)
    packed = pack_int4(q)
    cpu_weight, scale_and_zero = pack_int4_for_cpu(packed, scale, minimum)
    out = int4_mm_cpu(x, cpu_weight, scale_and_zero, group_size)
    assert out.shape == (2, 3, 48) and out.dtype == dtype
    # bfloat16 activations, and bfloat16 zero points shifted by a whole group's weights: 2 % leeway.
    assert relative_error(out, int4_matmul_reference(x, packed, scale, minimum)) < 2e-2
    # Reading the weights back out of the kernel's layout gives the same matrix, up to its bfloat16
    # scales and zero points (8 significant bits: within 2^-8 of the largest weight).
    torch.testing.assert_close(dequantize_int4_cpu(cpu_weight, scale_and_zero, group_size),
                               dequantize_int4(packed, scale, minimum), atol=2**-8 * w.abs().max().item(), rtol=0)


# --- Triton kernels, interpreted ------------------------------------------------------------------------
KERNEL_SCRIPT = textwrap.dedent("""
    import tempfile, torch
    from minfer.kernels.quant_matmul import int4_matmul, int4_matmul_reference, int8_matmul, int8_matmul_reference
    from minfer.formats.weights import pack_int4, quantize_int4_groupwise, quantize_int8_per_channel
    from minfer import LLM
    from minfer.lab.testing import random_checkpoint
    from minfer.quant import quantize_model
    import copy

    gen = torch.Generator().manual_seed(0)
    checked = 0
    # N not a multiple of the output tiles (32 wide for int8, 16 for int4); K not a multiple of the int8 kernel's
    # K step (64 for float32); K cut into slices (split-K, as on a GPU at decode sizes), the last slice short
    # (96 = 64 + 32) or empty (3 of 2 steps)
    for m, n, k in [(1, 72, 96), (5, 40, 128), (17, 64, 256)]:
        w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
        q, scale = quantize_int8_per_channel(w)
        for splits in (1, 2):
            torch.testing.assert_close(int8_matmul(x, q, scale, num_splits=splits), int8_matmul_reference(x, q, scale),
                                       atol=1e-4, rtol=1e-4)
            checked += 1
        for group_size in (32, 64, 128):
            if k % group_size:
                continue
            q4, s4, m4 = quantize_int4_groupwise(w, group_size)
            packed = pack_int4(q4)
            for splits in (1, 3):
                torch.testing.assert_close(int4_matmul(x, packed, s4, m4, num_splits=splits),
                                           int4_matmul_reference(x, packed, s4, m4), atol=1e-4, rtol=1e-4)
                checked += 1
    # float16 activations (the int4 kernel's magic-number path): one row and seven, every group size, K sliced.
    # The kernel rounds each weight q * scale + min once to float16, as the reference's float32 weight would
    # be; what is left is float16 output rounding (bfloat16 arithmetic needs a GPU: the interpreter has none)
    w, x16 = torch.randn(40, 256, generator=gen), torch.randn(7, 256, generator=gen).half()
    for group_size in (32, 64, 128):
        q4, s4, m4 = quantize_int4_groupwise(w, group_size)
        packed = pack_int4(q4)
        for rows, splits in ((1, 1), (7, 1), (7, 2)):
            got, want = int4_matmul(x16[:rows], packed, s4, m4, num_splits=splits), int4_matmul_reference(x16[:rows], packed, s4, m4)
            assert got.dtype == torch.float16
            torch.testing.assert_close(got.float(), want.float(), atol=2e-3 * want.float().abs().max().item(), rtol=0)
            checked += 1
    try:
        int8_matmul(x, q, scale, num_splits=5)  # K = 256: 4 steps of 64
        raise AssertionError("5 slices of 4 K steps were not refused")
    except ValueError as error:
        assert "num_splits must be between 1 and the 4 K steps of 64, got 5" in str(error), error
    # A whole (tiny) model on the Triton path gives the reference path's logits.
    llm = LLM(random_checkpoint(tempfile.mkdtemp(), "tiny"), dtype="float32", device="cpu")
    ids = torch.tensor([[5, 17, 300, 2, 99, 7]])
    positions = torch.arange(6)[None]
    for method in ("int8", "int4"):
        logits = {}
        for backend in ("reference", "triton"):
            model = quantize_model(copy.deepcopy(llm.model), method, backend=backend)
            logits[backend] = model(ids, positions, last_only=False)
        torch.testing.assert_close(logits["triton"], logits["reference"], atol=1e-4, rtol=1e-4)
        checked += 1
    print("triton == reference:", checked, "checks")
""")


def test_k_slices_leave_no_slice_empty(monkeypatch):
    from minfer.kernels import quant_matmul

    x = torch.zeros(1, 25 * 64)
    assert quant_matmul.k_slices(x, 576, 25 * 64, 16, 64, 64, 1) == (1, 25)  # the default: K whole
    assert quant_matmul.k_slices(x, 576, 25 * 64, 16, 64, 64, 6) == (6, 5)   # as asked: the sixth slice is empty
    monkeypatch.setattr(quant_matmul, "num_k_splits", lambda x, tiles, k_steps: 6)  # a GPU's choice, here
    assert quant_matmul.k_slices(x, 576, 25 * 64, 16, 64, 64, None) == (5, 5)  # 25 steps: five slices of five
    with pytest.raises(ValueError, match="num_splits must be between 1 and the 25 K steps of 64, got 26"):
        quant_matmul.k_slices(x, 576, 25 * 64, 16, 64, 64, 26)


@pytest.mark.slow
def test_triton_kernels_match_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "triton == reference: 31 checks" in done.stdout, done.stdout


# --- quantized models -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LLM:
    """A random model that was never quantized: int4 cannot ride on an earlier quantization here."""
    return LLM(random_checkpoint(str(tmp_path_factory.mktemp("tiny")), "tiny"), dtype="float32", device="cpu")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_llm_quantization_loads_and_generates(tiny, method):
    quantized = LLM(tiny.model_path, dtype="float32", device="cpu", quantization=method)
    layer = quantized.model.layers[0]
    kind = Int8Linear if method == "int8" else Int4Linear
    assert all(isinstance(m, kind) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert isinstance(quantized.model.lm_head, Int8Linear)
    assert isinstance(quantized.model.embed_tokens, torch.nn.Embedding)  # lookups stay exact
    assert method == "int8" or layer.mlp.down_proj.group_size == 64  # the default: the largest that divides 64
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = quantized.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 3]}], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]
    # A random model's logits are nearly flat, so compare logits rather than tokens.
    ids = torch.tensor([[5, 17, 300, 2, 99, 7]])
    positions = torch.arange(6)[None]
    expected, got = tiny.model(ids, positions, last_only=False), quantized.model(ids, positions, last_only=False)
    error = relative_error(got, expected)
    assert error < (0.02 if method == "int8" else 0.2), error


def test_backends_agree_on_a_model(tiny):
    ids = torch.tensor([[5, 17, 300, 2, 99, 7, 1, 4]])
    positions = torch.arange(8)[None]
    for method in ("int8", "int4"):
        fast = quantize_model(copy.deepcopy(tiny.model), method, backend="torch")
        reference = quantize_model(copy.deepcopy(tiny.model), method, backend="reference")
        assert fast.layers[0].mlp.down_proj.backend == "torch"
        assert relative_error(fast(ids, positions, last_only=False), reference(ids, positions, last_only=False)) < 0.02


def test_int4_falls_back_where_the_cpu_kernel_cannot_run():
    linear = torch.nn.Linear(64, 40, bias=True)  # 40 outputs: not a multiple of 16
    layer = Int4Linear.from_linear(linear, 32)
    assert layer.backend == "reference" and "divisible by 16" in layer.fallback_reason
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ layer.dequantize().T + linear.bias)
    with pytest.raises(ValueError, match="divisible by 16"):
        Int4Linear.from_linear(linear, 32, backend="torch")


INT8_CPU_SHAPES = textwrap.dedent("""
    import sys, torch
    from minfer.quant.linear import Int8Linear
    from minfer.kernels.quant_matmul import int8_matmul_reference
    torch.manual_seed(0)
    for in_features in map(int, sys.argv[1:]):
        layer = Int8Linear.from_linear(torch.nn.Linear(in_features, 16, bias=False))
        assert layer.backend == "torch", (in_features, layer.fallback_reason)
        for rows in (1, 2, 3, 70):  # the kernel below 64 rows, the dense path from there
            x = torch.randn(rows, in_features)
            want = int8_matmul_reference(x, layer.qweight, layer.scale)
            error = ((layer(x) - want).abs().max() / want.abs().max()).item()
            assert error < 2e-2, (in_features, rows, error)
    print("ok")
""")


def test_int8_falls_back_where_the_cpu_kernel_cannot_run():
    # PyTorch's CPU int8 kernel reads inputs 16 at a time with AVX-512: 24, 36 or 40 inputs gave wrong sums, NaN,
    # or a crash
    for in_features in (36, 40):
        linear = torch.nn.Linear(in_features, 16, bias=False)
        layer = Int8Linear.from_linear(linear)
        assert layer.backend == "reference" and "divisible by 16" in layer.fallback_reason
        for rows in (1, 3):
            x = torch.randn(rows, in_features)
            torch.testing.assert_close(layer(x), x @ layer.dequantize().T)
        with pytest.raises(ValueError, match="divisible by 16"):
            Int8Linear.from_linear(linear, backend="torch")
    # the widths it takes give the reference's sums (in a child process: a wrong width can crash it)
    done = subprocess.run([sys.executable, "-c", INT8_CPU_SHAPES, "16", "48", "80", "576"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_quantizing_twice_is_refused(tiny):
    once = quantize_model(copy.deepcopy(tiny.model), "int4", backend="reference")
    for method in ("int4", "int8"):
        with pytest.raises(ValueError, match="already quantized \\(int4\\): quantize the float model"):
            quantize_model(once, method)


def test_bad_quantization_arguments(tiny):
    with pytest.raises(ValueError, match="unknown quantization 'fp4': use one of .*'int8'.*'fp8'"):
        LLM(tiny.model_path, device="cpu", quantization="fp4")
    with pytest.raises(ValueError, match="applies to the int4 methods"):
        LLM(tiny.model_path, device="cpu", quantization="int8", quantization_group_size=64)
    with pytest.raises(ValueError, match="32, 64, 128"):
        LLM(tiny.model_path, device="cpu", quantization="int4", quantization_group_size=100)
    with pytest.raises(ValueError, match=r"\[32, 64\]"):  # 128 does not divide hidden_size 64
        LLM(tiny.model_path, device="cpu", quantization="int4", quantization_group_size=128)
    with pytest.raises(ValueError, match="backend"):
        quantize_model(copy.deepcopy(tiny.model), "int8", backend="gpu")
    with pytest.raises(ValueError, match="head"):
        quantize_model(copy.deepcopy(tiny.model), "int8", head="int4")


# --- the real model ---------------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def greedy_reference(llm):
    """The unquantized model's prompts + first 32 greedy tokens, and its logits over them."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]


def greedy_agreement(model, reference) -> float:
    """The share of the reference's greedy tokens the model also ranks first, given the same text so far."""
    same = total = 0
    for prompt, completion in reference:
        ids = torch.tensor([prompt + completion])
        logits = model(ids, torch.arange(ids.shape[1])[None], last_only=False)[0]
        predicted = logits[len(prompt) - 1:-1].argmax(-1)
        same += (predicted == torch.tensor(completion)).sum().item()
        total += len(completion)
    return same / total


# Measured (4 prompts x 32 tokens): int8 0.96, int4 g32 0.98 (the file's own Q4_1 grid, see below), int4 g64 0.75.
@pytest.mark.parametrize("method,group_size,bound", [("int8", None, 0.85), ("int4", 32, 0.85), ("int4", 64, 0.6)])
def test_real_model_greedy_agreement_and_bytes(llm, greedy_reference, method, group_size, bound):
    assert greedy_agreement(llm.model, greedy_reference) == 1.0  # the measure itself is sound
    model = quantize_model(copy.deepcopy(llm.model), method, group_size)
    agreement = greedy_agreement(model, greedy_reference)
    print(f"{method} g{group_size}: greedy agreement {agreement:.3f}")
    assert agreement >= bound
    bf16 = linear_weight_bytes(llm.model, unquantized_dtype=torch.bfloat16)
    ratio = bf16 / linear_weight_bytes(model)
    assert ratio >= {"int8": 1.9, 32: 3.1, 64: 3.5}[group_size or method], ratio
    assert model_weight_bytes(model) < model_weight_bytes(llm.model) / 2  # float32 -> quantized


def test_smollm2_group_sizes():
    from minfer.lab.testing import MODEL_SHAPES

    assert allowed_group_sizes(MODEL_SHAPES["smollm2-135m"]) == [32, 64]  # 576 = 4.5 x 128


# --- the GGUF file: Q4_1 is our int4 g32 ------------------------------------------------------------------
def test_gguf_q4_1_block_is_scale_times_code_plus_min(llm):
    path = resolve_model_path("smollm2-135m")
    block = q4_1_block(path, "blk.0.ffn_gate.weight", row=3, block=2)
    assert len(block["raw"]) == 20
    q, d, m = read_q4_1(path, "blk.0.ffn_gate.weight")
    assert block["d"] == d[3, 2].item() and block["m"] == m[3, 2].item()
    assert (block["q"] == q[3, 64:96].numpy()).all()
    # The loader (gguf's own decoder) gave the model exactly d * q + m: gate is the top half of gate_up_proj.
    loaded = llm.model.layers[0].mlp.gate_up_proj.weight[3, 64:96]
    assert torch.equal(torch.from_numpy(block["values"]), loaded)


def test_int4_g32_reproduces_the_q4_1_file():
    agreement = requantize_agreement(resolve_model_path("smollm2-135m"), "blk.2.ffn_down.weight")
    assert agreement["codes_equal"] > 0.999 and agreement["scales_equal"] > 0.999 and agreement["minimums_equal"] > 0.999
    assert agreement["max_weight_difference"] < 1e-3 * agreement["max_weight"]
