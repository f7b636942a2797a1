"""Mixtral, Qwen2-MoE, Qwen3-MoE (and dense Qwen3) against transformers, on tiny random checkpoints.

The checkpoints are made by transformers' own classes (`minfer.lab.testing.tiny_moe_checkpoint`), with
the routers' weights scaled up so that tokens really go to different experts.
"""
import json

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.layers.moe import distinct_experts, tokens_per_expert
from minfer.models.llama import LlamaModel
from minfer.models.loader import hf_config_to_model_config, load_model, save_hf_checkpoint
from minfer.models.moe import moe_blocks
from minfer.lab.testing import tiny_moe_checkpoint, word_tokenizer

VOCAB = 512
# (family, experts, top-k, overrides): several expert counts and k; sparse-layer selection in Qwen's two ways
CASES = {
    "mixtral-4x2": ("mixtral", 4, 2, {}),
    "mixtral-8x1": ("mixtral", 8, 1, {}),
    "qwen2_moe-8x2": ("qwen2_moe", 8, 2, {}),
    "qwen2_moe-6x3-step2": ("qwen2_moe", 6, 3, dict(num_hidden_layers=3, decoder_sparse_step=2)),
    "qwen3_moe-8x2-bias": ("qwen3_moe", 8, 2, dict(attention_bias=True)),
    "qwen3_moe-16x4-dense1": ("qwen3_moe", 16, 4, dict(num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen3": ("qwen3", 0, 0, dict(attention_bias=True)),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case name -> (folder, the transformers model), each built once."""
    built = {}

    def build(name):
        if name not in built:
            family, experts, k, overrides = CASES[name]
            folder = str(tmp_path_factory.mktemp(name))
            model = tiny_moe_checkpoint(folder, word_tokenizer(VOCAB), family, experts, k, vocab_size=VOCAB, **overrides)
            built[name] = folder, model
        return built[name]
    return build


def token_batch(seed=0, batch=3, length=24):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(checkpoint, name):
    folder, reference = checkpoint(name)
    loaded = load_model(folder)
    model = LlamaModel.from_weights(loaded.config, loaded.weights)
    ids = token_batch()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    for impl in ("reference", "grouped"):
        for block in moe_blocks(model):
            block.impl = impl
        ours = model(ids, positions, last_only=False)
        with torch.no_grad():
            theirs = reference(ids).logits
        assert (ours - theirs).abs().max().item() <= 1e-4, impl
    expected = {"qwen2_moe-6x3-step2": (1,), "qwen3_moe-16x4-dense1": (0, 2), "qwen3": ()}.get(name, (0, 1))
    assert loaded.config.sparse_layers == expected
    for block in moe_blocks(model):  # the routing really differs between tokens
        assert distinct_experts(block.last_expert_ids) > block.top_k
        assert tokens_per_expert(block.last_expert_ids, loaded.config.num_experts).sum() == ids.numel() * block.top_k


def test_a_wrong_routing_rule_is_caught(checkpoint):
    """The comparison can fail: Qwen3-MoE without renormalisation (Qwen2-MoE's rule) is off by far
    more than the tolerance."""
    folder, reference = checkpoint("qwen3_moe-16x4-dense1")
    loaded = load_model(folder)
    model = LlamaModel.from_weights(loaded.config, loaded.weights)
    for block in moe_blocks(model):
        block.normalize = False
    ids = token_batch()
    ours = model(ids, torch.arange(ids.shape[1]).expand_as(ids), last_only=False)
    with torch.no_grad():
        assert (ours - reference(ids).logits).abs().max().item() > 1e-3, "10x the tolerance"


@pytest.mark.parametrize("name", ["mixtral-4x2", "qwen2_moe-8x2", "qwen3_moe-16x4-dense1"])
def test_engine_greedy_matches_transformers_and_batched_equals_solo(checkpoint, name):
    """Through the paged engine with continuous batching: greedy tokens are transformers' own,
    and several requests together give what each gives alone."""
    folder, reference = checkpoint(name)
    llm = LLM(folder, dtype="float32", num_gpu_blocks_override=64, block_size=8, max_num_batched_tokens=32)
    prompts = [[int(t) for t in token_batch(seed, 1, 5 + 7 * seed)[0]] for seed in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(5)]
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.stats.steps > 0 and llm.engine.stats.step_distinct_experts  # the MoE metrics are kept
    solo = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    for prompt, sp, out, alone in zip(prompts, params, batched, solo):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                          max_new_tokens=sp.max_tokens, do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids == expected


def test_speculative_decoding_runs_moe_models(checkpoint):
    """The verify pass is an ordinary forward over 1 + k tokens: greedy output is plain greedy output."""
    folder, _ = checkpoint("qwen2_moe-8x2")
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [9, 10, 11, 9, 10]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(folder, dtype="float32", num_gpu_blocks_override=64).generate(prompts, params, use_tqdm=False)
    spec = LLM(folder, dtype="float32", num_gpu_blocks_override=64, speculative_model="[ngram]", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain]
    assert spec.engine.spec_stats.num_draft_tokens > 0


def test_engine_counts_tokens_per_expert(checkpoint):
    folder, _ = checkpoint("mixtral-8x1")
    llm = LLM(folder, dtype="float32", num_gpu_blocks_override=64, block_size=8)
    llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.engine.stats
    assert stats.step_tokens_per_expert.shape == (2, 8)  # [sparse layers, experts]
    assert stats.step_tokens_per_expert.sum(dim=1).tolist() == [1, 1]  # the last step decoded one token, top-1
    assert stats.expert_tokens.sum(dim=1).tolist() == [4 + 2, 4 + 2]  # prompt, then 2 decodes (the 3rd is sampled from them)
    assert stats.step_distinct_experts == [1, 1]
    assert 1 <= stats.mean_distinct_experts <= 8


def test_async_scheduling_counts_the_same_experts(checkpoint):
    """With async scheduling each step's routing is recorded when the step is launched and counted when it is read:
    the same tokens and the same token-expert pairs as the synchronous engine (nothing stops early: no wasted rows)."""
    folder, _ = checkpoint("qwen2_moe-8x2")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(folder, dtype="float32", num_gpu_blocks_override=64, block_size=8, async_scheduling=async_scheduling)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runs.append((tokens, llm.engine.stats.expert_tokens.tolist(), llm.engine.stats.moe_steps))
    assert runs[1] == runs[0]


@pytest.mark.parametrize("name", ["mixtral-4x2", "qwen2_moe-6x3-step2", "qwen3_moe-16x4-dense1", "qwen3"])
def test_saved_checkpoint_loads_in_transformers(checkpoint, tmp_path, name):
    """ModelConfig.to_hf_dict writes the experts back in transformers' names: the saved copy is the same model."""
    from transformers import AutoModelForCausalLM

    folder, reference = checkpoint(name)
    save_hf_checkpoint(load_model(folder), str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(again) is type(reference)
    ids = token_batch(batch=1)
    with torch.no_grad():
        assert (again(ids).logits - reference(ids).logits).abs().max().item() <= 1e-5


def test_unsupported_variants_say_what_is_missing(checkpoint):
    folder, _ = checkpoint("mixtral-4x2")
    hf = json.loads(open(f"{folder}/config.json").read())
    with pytest.raises(ValueError, match="multi-head latent attention"):
        hf_config_to_model_config({**hf, "model_type": "deepseek_v3"})
    with pytest.raises(ValueError, match="unsupported architecture 'jamba'.*mixtral"):
        hf_config_to_model_config({**hf, "model_type": "jamba"})
    with pytest.raises(ValueError, match="hidden_act"):
        hf_config_to_model_config({**hf, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        hf_config_to_model_config({**hf, "num_experts_per_tok": 5})


@pytest.mark.parametrize("args", [dict(quantization="int8"), dict(quantization="awq"), dict(tensor_parallel_size=2)])
def test_what_moe_models_cannot_do_yet_is_refused(checkpoint, args):
    folder, _ = checkpoint("mixtral-4x2")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(folder, num_gpu_blocks_override=16, **args)
