"""The GPU kernel benchmark's tables, run here on the CPU: the quantized-matmul rows with a stand-in timer
(do_bench needs CUDA), and the paged decode step against its baselines, whose SDPA baseline must compute
the same attention from its contiguous copy of the cache."""
import pytest
import torch
import triton.testing

import minfer.lab.bench.kernels as bench
from minfer.lab.bench.kernels import contiguous_cache, kernel_bandwidth, quant_matmul_speed, sdpa_decode
from minfer.kernels.paged_decode_attention import paged_decode_attention_reference


def test_quant_matmul_rows_and_bytes(monkeypatch):
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn: (fn(), 0.5)[1])  # every call "takes" 0.5 ms
    rows = quant_matmul_speed(96, 128, rows=1, dtype=torch.float32, group_sizes=(64,), device="cpu")
    assert [(r["format"], r["splits"]) for r in rows] == [("dense", None), ("int8", 1), ("int4", 1),
                                                          ("int8", "auto: 1"), ("int4", "auto: 1")]
    gb = {(r["format"], r["splits"]): r["weight_gb_per_s"] for r in rows}
    per_ms = 1e-9 / 0.5e-3
    assert gb["dense", None] == pytest.approx(96 * 128 * 4 * per_ms)             # float32 weights
    assert gb["int8", 1] == pytest.approx((96 * 128 + 4 * 96) * per_ms)          # codes + a float32 scale per row
    assert gb["int4", 1] == pytest.approx((96 * 64 + 2 * 96 * 2 * 2) * per_ms)   # nibbles + float16 scale, min per group
    assert all(r["us"] == pytest.approx(500) for r in rows)


def test_fp8_weights_join_the_matmul_rows_where_the_gpu_multiplies_in_fp8(monkeypatch):
    """From sm_89 on, an fp8 row (W8A8 through torch._scaled_mm, here its CPU version) follows the others."""
    import minfer.formats.hardware as hardware

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn: (fn(), 0.5)[1])
    monkeypatch.setattr(hardware, "cuda_capability", lambda device: (9, 0))
    rows = quant_matmul_speed(96, 128, rows=3, dtype=torch.bfloat16, group_sizes=(64,), device="cpu")
    assert [r["format"] for r in rows][-1] == "fp8" and rows[-1]["splits"] is None
    assert rows[-1]["weight_gb_per_s"] == pytest.approx((96 * 128 + 4 * 96) * 1e-9 / 0.5e-3)  # e4m3 + a float32 scale a row


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_sdpa_over_the_contiguous_copy_equals_the_paged_reference(int8):
    gen = torch.Generator().manual_seed(0)
    shape, context_len = (24, 4, 2, 16), 30  # 3 sequences of 30 tokens in 8 blocks of 4 each: a partial last block
    if int8:
        k_pool, v_pool = (torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8) for _ in range(2))
        scales = {"k_scales": torch.rand(shape[:3], generator=gen) / 127, "v_scales": torch.rand(shape[:3], generator=gen) / 127}
    else:
        k_pool, v_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        scales = {}
    tables = torch.randperm(24, generator=gen).to(torch.int32).view(3, 8)  # shuffled blocks
    q = torch.randn(3, 6, 16, generator=gen)  # 6 query heads over 2 KV heads
    k, v = (contiguous_cache(pool, tables, context_len, scales.get(name), torch.float32)
            for pool, name in ((k_pool, "k_scales"), (v_pool, "v_scales")))
    assert k.shape == (3, 2, context_len, 16) and k.is_contiguous()
    expected = paged_decode_attention_reference(q, k_pool, v_pool, tables, torch.full((3,), context_len, dtype=torch.int32),
                                                **scales)
    torch.testing.assert_close(sdpa_decode(q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_kernel_bandwidth_rows_and_bytes(monkeypatch):
    monkeypatch.setattr(bench, "best_time", lambda fn, repeats, device: (fn(), 0.5e-3)[1])  # every call "takes" 0.5 ms
    row = kernel_bandwidth(num_seqs=2, context_len=24, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                           dtype=torch.float32, peak_bytes_per_s=1e10, baselines=("gather", "sdpa"), device="cpu")
    kv_bytes = 2 * 2 * 24 * 2 * 16 * 4  # K and V, sequences x tokens x KV heads x head_dim x float32
    assert row["kv_mb"] == pytest.approx(kv_bytes / 2**20)
    assert row["kernel_ms"] == row["reference_ms"] == row["sdpa_ms"] == pytest.approx(0.5)
    assert row["kernel_gb_per_s"] == row["sdpa_gb_per_s"] == pytest.approx(kv_bytes / 0.5e-3 / 1e9)
    assert row["bandwidth_fraction"] == pytest.approx(kv_bytes / 0.5e-3 / 1e10)
    assert "sdpa_ms" not in kernel_bandwidth(num_seqs=1, context_len=8, num_heads=2, num_kv_heads=1, head_dim=16,
                                             dtype=torch.float32, peak_bytes_per_s=1e10, device="cpu")
    with pytest.raises(ValueError, match="baselines must be among"):
        kernel_bandwidth(num_seqs=1, context_len=8, peak_bytes_per_s=1e10, baselines=("flash",), device="cpu")
