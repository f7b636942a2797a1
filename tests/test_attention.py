"""Every attention backend against the written-out reference, on GQA shapes with and without masks."""
import pytest
import torch

from minfer.generate import attention_mask
from minfer.layers import attention as attention_module
from minfer.layers.attention import attention_reference, attention_sdpa, get_attention_fn


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (9, 1)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 17), (5, 5), (3, 11)])
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_matches_reference(heads, kv_heads, q_len, kv_len, padded):
    gen = torch.Generator().manual_seed(heads * 100 + kv_len)
    q = torch.randn(2, heads, q_len, 16, generator=gen)
    k = torch.randn(2, kv_heads, kv_len, 16, generator=gen)
    v = torch.randn(2, kv_heads, kv_len, 16, generator=gen)
    valid = torch.ones(2, kv_len, dtype=torch.bool)
    if padded:
        valid[1, : kv_len // 2] = False  # the second row is left-padded
    mask = attention_mask(valid, q_len)
    torch.testing.assert_close(attention_sdpa(q, k, v, mask), attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 7, 8, 20])  # both sides of DECODE_MATMUL_MIN_BATCH
@pytest.mark.parametrize("pool_order", [True, False])  # K/V in memory KV head first (paged pool) or sequence first
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_paths_match_reference(batch, pool_order, dtype, tolerance):
    """One query per sequence, K/V as the paged pool gathers them ([kv_heads, batch, ...] in memory,
    seen as [batch, kv_heads, ...]) or as a contiguous cache holds them; each sequence sees its own
    number of keys."""
    gen = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, 9, 1, 16, generator=gen).to(dtype)
    if pool_order:
        k = torch.randn(3, batch, 40, 16, generator=gen).to(dtype).transpose(0, 1)
        v = torch.randn(3, batch, 40, 16, generator=gen).to(dtype).transpose(0, 1)
    else:
        k, v = torch.randn(batch, 3, 40, 16, generator=gen).to(dtype), torch.randn(batch, 3, 40, 16, generator=gen).to(dtype)
    lengths = torch.randint(1, 41, (batch,), generator=gen)
    mask = (torch.arange(40)[None] < lengths[:, None])[:, None, None, :]
    expected = attention_reference(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(attention_sdpa(q, k, v, mask).float(), expected, rtol=tolerance, atol=tolerance)


def test_padding_query_rows_stay_finite():
    valid = torch.tensor([[False, False, True, True]])
    mask = attention_mask(valid, 4)
    out = attention_reference(torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), mask)
    assert torch.isfinite(out).all()


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown attention backend 'flash9'.*'reference', 'sdpa'"):
        get_attention_fn("flash9")


def test_decode_matmuls_widen_bfloat16_where_its_matmuls_are_slow(monkeypatch):
    """Without bf16 instructions (an AVX2-only CPU) the batched decode matmuls run bfloat16 K/V in float32: the
    output is still bfloat16, but its scores were not rounded to bfloat16, so it sits closer to the float32 result."""
    gen = torch.Generator().manual_seed(0)
    batch = 16  # >= DECODE_MATMUL_MIN_BATCH: the two-matmul path
    q = torch.randn(batch, 9, 1, 64, generator=gen).bfloat16()
    k = (4 * torch.randn(3, batch, 200, 64, generator=gen)).bfloat16().transpose(0, 1)  # pool order, large scores
    v = torch.randn(3, batch, 200, 64, generator=gen).bfloat16().transpose(0, 1)
    expected = attention_reference(q.float(), k.float(), v.float(), None)
    errors = {}
    for fast in (True, False):
        monkeypatch.setattr(attention_module, "bf16_matmuls_fast", lambda device_type: fast)
        out = attention_sdpa(q, k, v, None)
        assert out.dtype == torch.bfloat16
        errors[fast] = (out.float() - expected).abs().max().item()
    torch.testing.assert_close(out.float(), expected.bfloat16().float(), rtol=8e-3, atol=8e-3)  # one rounding
    assert errors[False] < errors[True], errors
