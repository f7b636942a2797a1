"""The real-size speed lesson (minfer/lab/bench/real_size.py): the shapes are Llama's (parameter counts as published),
and the measurement runs end to end on the CPU with a toy shape, dense first, every format against it."""
import torch

from minfer.lab.bench.real_size import random_model, real_size_decode


def test_the_shapes_have_the_published_sizes():
    # built on the meta device: shapes only, no memory
    assert sum(p.numel() for p in random_model("llama-3.1-8b", torch.bfloat16, "meta").parameters()) == 8_030_261_248
    assert sum(p.numel() for p in random_model("llama-3.2-1b", torch.bfloat16, "meta").parameters()) == 1_235_814_400


def test_random_weights_are_seeded_and_norms_are_one():
    a, b = (random_model("tiny", torch.float32, "cpu", seed=3) for _ in range(2))
    assert torch.equal(a.layers[0].mlp.down_proj.weight, b.layers[0].mlp.down_proj.weight)
    assert 0.015 < a.layers[0].mlp.down_proj.weight.std() < 0.025
    assert torch.all(a.norm.weight == 1)


def test_every_format_is_timed_against_dense_at_each_batch():
    columns = real_size_decode("tiny", ("int8", "int4"), (1, 2), prompt_len=8, max_tokens=4, device="cpu",
                               dtype=torch.float32, kv_cache_memory_bytes=1 << 22)
    assert columns["weights"] == ["none", "none", "int8", "int8", "int4", "int4"]
    assert columns["batch"] == [1, 2] * 3
    assert columns["x dense"][:2] == [1.0, 1.0] and all(s > 0 for s in columns["tokens/s"])
    for i in range(2, 6):  # each ratio is its speed over dense's at the same batch
        dense = columns["tokens/s"][columns["batch"][i] - 1]
        assert abs(columns["x dense"][i] - columns["tokens/s"][i] / dense) < 0.02
