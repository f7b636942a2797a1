"""The MoE layer's three implementations against the reference: the fused Triton kernels (under
TRITON_INTERPRET=1 without a GPU, on small shapes), the grouped CPU path, and the routing rule.

tests/conftest.py switches the interpreter on before triton is first imported.
"""
import pytest
import torch

from minfer.kernels.fused_moe import align_by_expert, align_by_expert_reference, fused_moe
from minfer.layers.moe import (distinct_experts, moe_mlp, moe_mlp_grouped, moe_mlp_reference, route_topk,
                               tokens_per_expert)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (tokens, hidden, intermediate, experts, top-k): one decode row; sizes that are not multiples of
# the tiles (masks); more experts than pairs (most of them unused)
SHAPES = [(1, 32, 48, 8, 2), (13, 40, 24, 6, 3), (37, 64, 80, 16, 4), (5, 32, 32, 4, 1), (3, 16, 16, 32, 2)]
# of the largest output; float32 exact on a GPU too (input_precision="ieee")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def problem(tokens, hidden, inter, experts, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    weights, ids = route_topk(torch.randn(tokens, experts, generator=g) * 3, k, normalize=True)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up, down = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2, torch.randn(experts, hidden, inter, generator=g) * 0.2
    return [t.to(DEVICE, dtype) for t in (x, weights)] + [ids.to(DEVICE)] + [t.to(DEVICE, dtype) for t in (gate_up, down)]


def test_route_topk_is_transformers_rule():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 0.0]])
    probs = torch.softmax(logits, -1)
    weights, ids = route_topk(logits, 2, normalize=False)  # Qwen2-MoE: the softmax probabilities themselves
    assert ids.tolist() == [[0, 1], [2, 1]] and weights.dtype == torch.float32
    torch.testing.assert_close(weights, probs.gather(1, ids))
    normalized, _ = route_topk(logits.bfloat16(), 2, normalize=True)  # Mixtral, Qwen3-MoE; softmax in float32
    assert normalized.dtype == torch.float32
    torch.testing.assert_close(normalized.sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 5, True)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("shape", SHAPES)
def test_align_by_expert_matches_its_reference(shape, block_m):
    _, _, ids, _, _ = problem(*shape)
    experts = shape[3]
    pairs, blocks = align_by_expert(ids, experts, block_m)
    want_pairs, want_blocks = align_by_expert_reference(ids.cpu(), experts, block_m)
    used = len(want_blocks)
    assert blocks[:used].tolist() == want_blocks and pairs[:used * block_m].tolist() == want_pairs
    assert (blocks[used:] == -1).all() and (pairs[used * block_m:] == -1).all()  # the worst-case tail is unused
    assert sorted(p for p in want_pairs if p >= 0) == list(range(ids.numel()))  # every pair exactly once


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_reference(shape, dtype):
    args = problem(*shape, dtype=dtype)
    expected = moe_mlp_reference(*args)
    got = fused_moe(*args)
    assert got.dtype == dtype and got.shape == expected.shape
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype] * max(1.0, scale)


def test_fused_moe_tile_height_and_the_layer_dispatch():
    args = problem(13, 40, 24, 6, 3, seed=1)
    expected = moe_mlp_reference(*args)
    torch.testing.assert_close(fused_moe(*args, block_m=32), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(moe_mlp(*args, impl="triton"), expected, atol=1e-4, rtol=1e-4)


def test_fused_moe_in_a_model():
    """A whole (tiny, random) Qwen2-MoE-shaped model: its logits through the kernels are the reference's."""
    from minfer.config import ModelConfig
    from minfer.models.llama import LlamaModel
    from minfer.models.moe import moe_blocks

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                         tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                         norm_topk_prob=False, shared_expert_intermediate_size=24, sparse_layers=(0, 1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaModel(config).eval().to(DEVICE)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    positions = torch.arange(9, device=DEVICE).expand_as(ids)
    logits = {}
    for impl in ("reference", "triton"):
        for block in moe_blocks(model):
            block.impl = impl
        logits[impl] = model(ids, positions, last_only=False)
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_matches_reference(shape):
    x, weights, ids, gate_up, down = (t.cpu() for t in problem(*shape))
    expected = moe_mlp_reference(x, weights, ids, gate_up, down)
    torch.testing.assert_close(moe_mlp_grouped(x, weights, ids, gate_up, down), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(moe_mlp(x, weights, ids, gate_up, down), expected, atol=1e-4, rtol=1e-4)  # auto


def test_reference_is_differentiable():
    x, weights, ids, gate_up, down = (t.cpu() for t in problem(13, 40, 24, 6, 3))
    logits = torch.randn(13, 6, requires_grad=True)
    gate_up.requires_grad_(True)
    weights, ids = route_topk(logits, 3, normalize=True)
    moe_mlp(x, weights, ids, gate_up, down, impl="reference").square().sum().backward()
    assert logits.grad.abs().sum() > 0  # through the routing weights to the router
    used = tokens_per_expert(ids, 6) > 0
    assert (gate_up.grad.flatten(1).abs().sum(1) > 0).tolist() == used.tolist()  # exactly the experts that ran


def test_load_statistics():
    ids = torch.tensor([[0, 3], [3, 1], [0, 3]])
    assert tokens_per_expert(ids, 5).tolist() == [2, 1, 0, 3, 0]
    assert distinct_experts(ids) == 3


def test_bad_shapes_and_names_are_refused():
    x, weights, ids, gate_up, down = (t.cpu() for t in problem(5, 32, 32, 4, 1))
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        moe_mlp(x, weights, ids, gate_up, down, impl="fast")
    with pytest.raises(ValueError, match="x must be"):
        moe_mlp(x[None], weights, ids, gate_up, down)
    with pytest.raises(ValueError, match="expert_ids must both be"):
        moe_mlp(x, weights, ids[:3], gate_up, down)
    with pytest.raises(ValueError, match="gate_up must be"):
        moe_mlp(x, weights, ids, gate_up[:, :, :16], down)
    with pytest.raises(ValueError, match="down must be"):
        moe_mlp(x, weights, ids, gate_up, down[:3])
    with pytest.raises(ValueError, match="integer"):
        moe_mlp(x, weights, ids.float(), gate_up, down)

