"""One build plan (minfer/engine/build.py): every refusal row can be hit, each with its own message; what is
allowed is resolved once (scheme, group size, calibration, shard shape); rank 0 and a worker build from one plan."""
import dataclasses

import pytest
import torch

from minfer.config import EngineConfig, ModelConfig
from minfer.engine.build import build_model, check_combinations, plan, rank_checkpoint, refusals
from minfer.layers.parallel_linear import CommStats
from minfer.models.loader import load_model
from minfer.lab.testing import random_checkpoint

DENSE = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=128,
                    tie_word_embeddings=True)
MOE = dataclasses.replace(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, sparse_layers=(1,))
STORED_INT4 = {"method": "int4", "group_size": 32}


def config(**kwargs) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", **kwargs)


# One case per row of `refusals`, in its order: (engine arguments, model, stored quantization, attention, message).
CASES = [
    (dict(quantization="int8"), DENSE, STORED_INT4, "sdpa", r"is a 'int4' checkpoint \(group size 32\)"),
    (dict(carve_experts=4, carve_top_k=2), DENSE, STORED_INT4, "sdpa", "needs an unquantized model"),
    (dict(carve_experts=4, carve_top_k=2, quantization="int8"), DENSE, None, "sdpa", "in one process"),
    (dict(carve_experts=4, carve_top_k=2), MOE, None, "sdpa", "needs a dense model"),
    (dict(quantization="int8"), MOE, None, "sdpa", "does not support mixture-of-experts"),
    (dict(tensor_parallel_size=2, speculative_model="[ngram]", num_speculative_tokens=2), DENSE, None, "sdpa",
     "does not support speculative decoding"),
    (dict(tensor_parallel_size=2, quantization="awq"), DENSE, None, "sdpa", "its calibration runs the whole model"),
    (dict(tensor_parallel_size=2), DENSE, STORED_INT4, "sdpa", "a saved quantized checkpoint"),
    (dict(tensor_parallel_size=2, enforce_eager=False), DENSE, None, "sdpa", "compiled decode"),
    (dict(tensor_parallel_size=2), DENSE, None, lambda *args: None, "an attention function"),
]


def test_every_row_is_covered_here():
    # the last two rows (CUDA devices, a running group) depend on the machine: test_tensor_parallel covers them
    assert len(refusals(config(), DENSE, None, "sdpa")) == len(CASES) + 2


@pytest.mark.parametrize("row", range(len(CASES)))
def test_each_refusal_names_the_combination(row):
    kwargs, model, stored, attention, message = CASES[row]
    engine = config(**kwargs)
    hits = [i for i, (hit, _) in enumerate(refusals(engine, model, stored, attention)) if hit]
    assert row in hits, "the case must hit its own row"
    with pytest.raises(ValueError, match=message):
        plan(engine, model, stored, attention)


def test_before_loading_only_the_arguments_are_judged():
    check_combinations(config(quantization="int8"), None, None, "sdpa")  # MoE or not: not known yet
    with pytest.raises(ValueError, match="in one process"):
        check_combinations(config(carve_experts=4, carve_top_k=2, tensor_parallel_size=2), None, None, "sdpa")


def test_what_the_plan_resolves():
    int4 = plan(config(quantization="int4"), DENSE)
    assert (int4.quantization, int4.group_size, int4.calibrated, int4.stored) == ("int4", 64, False, False)
    assert plan(config(quantization="awq"), DENSE).calibrated
    stored = plan(config(quantization="int4"), DENSE, STORED_INT4)  # asking for what is stored: built as stored
    assert (stored.quantization, stored.stored) == (None, True)
    shard = plan(config(tensor_parallel_size=2, quantization="int4", quantization_group_size=32), DENSE)
    assert (shard.model_config.num_heads, shard.model_config.intermediate_size, shard.group_size) == (2, 64, 32)
    with pytest.raises(ValueError, match="int4 group size 64 does not divide a shard"):
        plan(config(tensor_parallel_size=2, quantization="int4", quantization_group_size=64), DENSE)
    carved = plan(config(carve_experts=4, carve_top_k=2), DENSE)
    assert carved.carve == (4, 2) and carved.quantization is None


def test_rank_zero_and_a_worker_build_their_shards_from_one_plan(tmp_path):
    loaded = load_model(random_checkpoint(str(tmp_path), DENSE), torch.float32)
    build = plan(config(tensor_parallel_size=2), DENSE)
    shards = [rank_checkpoint(build, loaded, rank) for rank in (0, 1)]
    q_rows = DENSE.num_heads // 2 * DENSE.head_dim
    q = loaded.weights["model.layers.0.self_attn.q_proj.weight"]
    for rank, shard in enumerate(shards):
        assert torch.equal(shard.weights["model.layers.0.self_attn.q_proj.weight"], q[rank * q_rows:(rank + 1) * q_rows])
        model = build_model(build, shard, rank, CommStats())
        assert model.config.num_heads == 2 and model.layers[0].self_attn.qkv_proj.out_features == 2 * q_rows
    assert shards[1].tokenizer is None and shards[0].tokenizer is loaded.tokenizer  # only rank 0 calibrates or carves
    alone = plan(config(), DENSE)
    assert rank_checkpoint(alone, loaded, 0) is loaded
    assert build_model(alone, loaded).layers[0].self_attn.qkv_proj.out_features == 4 * q_rows
