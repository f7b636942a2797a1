"""Experts carved from a dense model (minfer.moe.carve): all E experts give the dense model back, fewer
change it; the clustering is balanced and groups co-firing neurons; the LLM option and its errors."""
import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.moe.carve import CarvedMoE, balanced_assign, carve_model, cluster_neurons, set_top_k
from minfer.lab.testing import tiny_llama


def _calibration(model, n=128, seed=0):
    return torch.randint(model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_all_experts_give_the_dense_model_back_and_fewer_do_not():
    dense, carved = tiny_llama(), tiny_llama()
    carve_model(carved, _calibration(carved), num_experts=4, top_k=4, window=32)
    assert all(isinstance(layer.mlp, CarvedMoE) for layer in carved.layers)
    assert carved.layers[0].mlp.gate_up.shape == (4, 2 * 12, 32) and carved.layers[0].mlp.down.shape == (4, 32, 12)
    ids = torch.tensor([_calibration(dense, 24, seed=5)])
    positions = torch.arange(24)[None]
    reference = dense(ids, positions, last_only=False)
    assert torch.allclose(carved(ids, positions, last_only=False), reference, atol=1e-4)
    set_top_k(carved, 1)
    assert not torch.allclose(carved(ids, positions, last_only=False), reference, atol=1e-3)
    assert carved.layers[0].mlp.last_expert_ids.shape == (24, 1)


def test_balanced_assign_fills_every_cluster_exactly():
    similarity = torch.randn(40, 5, generator=torch.Generator().manual_seed(0))
    similarity[:, 0] += 10  # every row prefers cluster 0: only 8 may have it
    assignment = balanced_assign(similarity, 8)
    assert torch.bincount(assignment, minlength=5).tolist() == [8] * 5
    assert set(torch.argsort(similarity[:, 0], descending=True)[:8].tolist()) == set(torch.where(assignment == 0)[0].tolist())


def test_clustering_groups_neurons_that_fire_together():
    gen = torch.Generator().manual_seed(0)
    tokens, groups, size = 200, 4, 6
    which = torch.randint(groups, (tokens,), generator=gen)  # each token wakes one hidden group of neurons
    truth = torch.arange(groups).repeat_interleave(size)[torch.randperm(groups * size, generator=gen)]
    activations = (which[:, None] == truth[None]).float() * (1 + torch.rand(tokens, groups * size, generator=gen))
    found = cluster_neurons(activations + 0.01 * torch.rand(tokens, groups * size, generator=gen), groups)
    assert sorted(sorted(truth[g].tolist()) for g in found) == [[e] * size for e in range(groups)]


def test_llm_carves_at_load_time(random_tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["hello world", "the a b c"]
    dense = LLM(random_tiny_dir, device="cpu", num_gpu_blocks_override=32)
    carved = LLM(random_tiny_dir, device="cpu", num_gpu_blocks_override=32, carve_experts=4, carve_top_k=4)
    assert all(isinstance(layer.mlp, CarvedMoE) for layer in carved.model.layers)
    expected = [o.outputs[0].token_ids for o in dense.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in carved.generate(prompts, params, use_tqdm=False)] == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(carve_experts=8), "go together"),
    (dict(carve_top_k=2), "go together"),
    (dict(carve_experts=1, carve_top_k=1), "integer >= 2"),
    (dict(carve_experts=8, carve_top_k=9), r"\[1, carve_experts=8\]"),
    (dict(carve_experts=8, carve_top_k=0), r"\[1, carve_experts=8\]"),
    (dict(carve_experts=8, carve_top_k=2, quantization="int8"), "unquantized"),
])
def test_bad_carve_arguments_are_refused_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("/nonexistent/model", **kwargs)


def test_carve_experts_must_divide_the_intermediate_size():
    with pytest.raises(ValueError, match="divide the MLP's intermediate size 48"):
        carve_model(tiny_llama(), _calibration(tiny_llama()), num_experts=5, top_k=1, window=32)
    with pytest.raises(ValueError, match="no carved experts"):
        set_top_k(tiny_llama(), 1)
