"""Chapter 11: column- and row-parallel linears against the unsplit matmul (and a split MLP against the
unsplit one), all-reduce counts and bytes against the calls a split model really makes, memory per
device against the parameters of minfer's own shards."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from minfer.config import ModelConfig
from minfer.layers import parallel_linear
from minfer.layers.parallel_linear import shard_model_config, split_columns, split_rows
from minfer.models.llama import LlamaModel
from minfer.lab.testing import MODEL_SHAPES

SMOLLM2 = MODEL_SHAPES["smollm2-135m"]


def test_column_parallel_is_slices_of_the_output(impl):
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 24, dtype=torch.float64), torch.randn(12, 24, dtype=torch.float64)
    for n in (1, 2, 3, 4):
        outs = impl.column_parallel_linear(x, [split_rows(w, r, n) for r in range(n)])
        assert len(outs) == n and all(o.shape == (3, 5, 12 // n) for o in outs)
        torch.testing.assert_close(torch.cat(outs, dim=-1), x @ w.T)


def test_row_parallel_sums_partial_products(impl):
    torch.manual_seed(1)
    x, w = torch.randn(7, 24, dtype=torch.float64), torch.randn(10, 24, dtype=torch.float64)
    for n in (1, 2, 3, 4):
        out = impl.row_parallel_linear([split_columns(x, r, n) for r in range(n)], [split_columns(w, r, n) for r in range(n)])
        torch.testing.assert_close(out, x @ w.T)
    with pytest.raises(ValueError):
        impl.row_parallel_linear([x[:, :12], x[:, 12:]], [w])


def test_column_then_row_mlp_equals_the_unsplit_mlp(impl):
    """SwiGLU split Megatron's way: gate and up column-parallel, down row-parallel, one sum at the end."""
    torch.manual_seed(2)
    h, inter = 16, 48
    x = torch.randn(4, h, dtype=torch.float64)
    gate, up, down = (torch.randn(inter, h, dtype=torch.float64), torch.randn(inter, h, dtype=torch.float64),
                      torch.randn(h, inter, dtype=torch.float64))
    full = (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    n = 3
    gates = impl.column_parallel_linear(x, [split_rows(gate, r, n) for r in range(n)])
    ups = impl.column_parallel_linear(x, [split_rows(up, r, n) for r in range(n)])
    hidden = [F.silu(g) * u for g, u in zip(gates, ups)]  # element-wise: each device on its own slice
    out = impl.row_parallel_linear(hidden, [split_columns(down, r, n) for r in range(n)])
    torch.testing.assert_close(out, full)


def test_all_reduce_count_and_bytes_match_a_split_model(impl, monkeypatch):
    """Run a real minfer shard with torch.distributed's all_reduce counted (no other process needed:
    a stand-in sums nothing), and compare with the formula."""
    config = dataclasses.replace(MODEL_SHAPES["tiny"], num_layers=3)
    n, tokens = 2, 5
    shard = LlamaModel(shard_model_config(config, n)).eval()
    calls = []
    monkeypatch.setattr(parallel_linear.dist, "all_reduce", lambda t, group=None: calls.append(t.numel() * t.element_size()))
    stats = parallel_linear.CommStats()
    parallel_linear.wrap_row_parallel(shard, stats)
    shard(torch.zeros(1, tokens, dtype=torch.long), torch.arange(tokens)[None])
    count, payload, ring = impl.all_reduce_per_token(config.num_layers, config.hidden_size, n, 4)
    assert count == len(calls) == 6
    assert payload * tokens == sum(calls)
    assert ring == pytest.approx(payload * 2 * (n - 1) / n)
    assert impl.all_reduce_per_token(30, 576, 3, 2) == (60, 60 * 576 * 2, pytest.approx(60 * 576 * 2 * 4 / 3))
    assert impl.all_reduce_per_token(80, 8192, 1, 2) == (0, 0, 0.0)
    with pytest.raises(ValueError):
        impl.all_reduce_per_token(2, 64, 0, 4)


def test_all_reduce_time(impl):
    assert impl.all_reduce_seconds(1e6, 1, 1e9, 1e-5) == 0.0
    assert impl.all_reduce_seconds(1e6, 2, 1e9, 1e-5) == pytest.approx(1e-5 + 1e6 / 1e9)
    assert impl.all_reduce_seconds(8e6, 8, 4e11, 0.0) == pytest.approx(2 * 7 / 8 * 8e6 / 4e11)
    assert impl.all_reduce_seconds(16, 8, 4e11, 8e-6) == pytest.approx(8e-6, rel=1e-3)  # small: latency only


@pytest.mark.parametrize("shape", ["smollm2", "qwen_untied"])
def test_weight_bytes_match_minfer_shards(impl, shape):
    config = SMOLLM2 if shape == "smollm2" else ModelConfig(1000, 64, 96, 3, 8, 4, 8, 1e4, 1e-5, 128, False,
                                                             attention_bias=True, architecture="qwen2")
    for n in ([1, 3] if shape == "smollm2" else [1, 2, 4]):
        with torch.device("meta"):
            shard = LlamaModel(shard_model_config(config, n))
        params = sum(p.numel() for p in shard.parameters())  # a tied head counted once
        assert impl.weight_bytes_per_device(config, n, 2, vocab_parallel=False) == pytest.approx(2 * params)
        vocab = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
        assert impl.weight_bytes_per_device(config, n, 4) == pytest.approx(4 * (params - vocab + vocab / n))


def test_kv_cache_bytes_match_the_shards_pool(impl):
    for n in (1, 3):
        shard = shard_model_config(SMOLLM2, n)
        assert impl.kv_cache_bytes_per_device(SMOLLM2, n, 1000, 2) == 1000 * shard.kv_bytes_per_token(torch.bfloat16)
    llama70b = dataclasses.replace(SMOLLM2, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128)
    assert impl.kv_cache_bytes_per_device(llama70b, 16, 1, 2) == 2 * 80 * 1 * 128 * 2  # 8 KV heads on 16: one each
