"""The GPU kernel benchmark's quantized-matmul table, run here with a stand-in timer (do_bench needs CUDA):
one dense row, int8 and int4 unsplit and split, and weight bytes that match each format's storage."""
import pytest
import torch
import triton.testing

from minfer.bench.kernels import quant_matmul_speed


def test_quant_matmul_rows_and_bytes(monkeypatch):
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn: (fn(), 0.5)[1])  # every call "takes" 0.5 ms
    rows = quant_matmul_speed(96, 128, rows=1, dtype=torch.float32, group_size=64, device="cpu")
    assert [(r["format"], r["splits"]) for r in rows] == [("dense", None), ("int8", 1), ("int4", 1),
                                                          ("int8", "auto: 1"), ("int4", "auto: 1")]
    gb = {(r["format"], r["splits"]): r["weight_gb_per_s"] for r in rows}
    per_ms = 1e-9 / 0.5e-3
    assert gb["dense", None] == pytest.approx(96 * 128 * 4 * per_ms)             # float32 weights
    assert gb["int8", 1] == pytest.approx((96 * 128 + 4 * 96) * per_ms)          # codes + a float32 scale per row
    assert gb["int4", 1] == pytest.approx((96 * 64 + 2 * 96 * 2 * 2) * per_ms)   # nibbles + float16 scale, min per group
    assert all(r["us"] == pytest.approx(500) for r in rows)
