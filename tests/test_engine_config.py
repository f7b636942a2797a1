"""EngineConfig checks every serving argument in one place; the model runner packs a step as the
paged layout says (slots, logits rows), and KV bytes follow one formula."""
import dataclasses

import pytest
import torch

from minfer.config import EngineConfig, ModelConfig
from minfer.engine.block_manager import BlockManager
from minfer.engine.model_runner import ModelRunner
from minfer.models.llama import LlamaModel
from minfer.outputs import RequestMetrics
from minfer.sampling_params import SamplingParams
from minfer.sequence import Sequence

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=8192, tie_word_embeddings=True)
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=128,
                   tie_word_embeddings=True)


def test_kv_bytes_per_token_by_hand():
    # K and V x 30 layers x 3 KV heads x (64 values x 2 bytes) for bfloat16
    assert SMOLLM2.kv_bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 128 == 23040
    assert SMOLLM2.kv_bytes_per_token(torch.float32) == 46080
    # int8: 64 one-byte values and a 4-byte float32 scale per (token, KV head)
    assert SMOLLM2.kv_bytes_per_token(torch.bfloat16, "int8") == 2 * 30 * 3 * 68 == 12240
    # fp8: 64 one-byte values; the scales are per (layer, KV head), not per token
    assert SMOLLM2.kv_bytes_per_token(torch.bfloat16, "fp8") == 2 * 30 * 3 * 64 == 11520
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        SMOLLM2.kv_bytes_per_token(torch.float32, "fp8_e5m2")


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "block_size must be an integer >= 1"),
    ("max_num_seqs", 2.5, "max_num_seqs must be an integer >= 1"),
    ("max_num_batched_tokens", True, "max_num_batched_tokens must be an integer >= 1"),
    ("num_gpu_blocks_override", -3, "num_gpu_blocks_override must be an integer >= 1"),
    ("gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be in \(0, 1\]"),
    ("kv_cache_dtype", "fp8_e5m2", "kv_cache_dtype must be 'auto'"),
    ("quantization", "int3", "unknown quantization 'int3'"),
    ("dtype", "float64", "unknown dtype 'float64'"),
    ("device", "tpu", "unknown device 'tpu'"),
    ("device", "meta", "device 'meta' is not one minfer runs on"),
    ("dtype", torch.int8, "dtype torch.int8 is not one minfer runs in"),
    ("dtype", torch.float64, "dtype torch.float64 is not one minfer runs in"),
    ("enforce_eager", "yes", "enforce_eager must be True, False or None"),
    ("num_speculative_tokens", 4, "speculative_model and num_speculative_tokens go together"),
])
def test_each_bad_argument_is_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_a_group_size_must_be_an_integer():
    # 64.0 == 64, so "in (32, 64, 128)" let it through, and reshape failed far from the cause
    for size in (64.0, True):
        with pytest.raises(ValueError, match=r"quantization_group_size must be one of \(32, 64, 128\)"):
            EngineConfig(quantization="int4", quantization_group_size=size)


def test_unknown_argument_lists_the_allowed_ones():
    with pytest.raises(TypeError, match=r"LLM\(\) got unexpected keyword arguments \['max_seqs'\].*'max_num_seqs'"):
        EngineConfig.from_kwargs("LLM()", max_seqs=4)


def test_fit_to_model_fills_the_window_and_the_budget():
    config = EngineConfig(device="cpu")
    config.fit_to_model(SMOLLM2)
    assert (config.max_model_len, config.max_num_batched_tokens) == (8192, 512)
    assert config.dtype == torch.float32 and config.device == torch.device("cpu")
    unchunked = EngineConfig(device="cpu", enable_chunked_prefill=False, max_model_len=300)
    unchunked.fit_to_model(SMOLLM2)
    assert unchunked.max_num_batched_tokens == 300
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[1, 8192\]"):
        EngineConfig(max_model_len=9000).fit_to_model(SMOLLM2)
    with pytest.raises(ValueError, match="without chunked prefill, max_num_batched_tokens"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64).fit_to_model(SMOLLM2)


def _sequence(prompt: list[int], params: SamplingParams) -> Sequence:
    return Sequence(prompt, params, 8, 0, RequestMetrics(0.0, num_prompt_tokens=len(prompt)))


def test_runner_packs_prefills_then_decodes_with_their_slots_and_logits_rows():
    torch.manual_seed(0)
    model = LlamaModel(TINY).eval()
    config = EngineConfig(device="cpu", block_size=4, num_gpu_blocks_override=16)
    config.fit_to_model(TINY)
    runner = ModelRunner(model, config)
    blocks = BlockManager(16, 4)
    greedy = SamplingParams(temperature=0)
    decoding, prefilling, scored = (_sequence(list(range(1, 7)), greedy), _sequence(list(range(10, 19)), greedy),
                                    _sequence(list(range(20, 25)), SamplingParams(temperature=0, prompt_logprobs=0)))
    for seq in (decoding, prefilling, scored):
        seq.block_table, _ = blocks.allocate(seq.token_ids)
    decoding.num_computed = 5  # its last token is new: a decode
    prefilling.num_computed = 4  # a chunk of 3 of its 5 remaining prompt tokens
    # scored: its first chunk of 5, all of its prompt
    step = runner.prepare([(decoding, 1), (prefilling, 3), (scored, 5)])
    # prefills first, the decode last, then padding up to the bucket of 16 (minfer.engine.buckets)
    assert step.input_ids.tolist() == [[14, 15, 16, 20, 21, 22, 23, 24, 6] + [0] * 7]
    assert step.positions.tolist() == [[4, 5, 6, 0, 1, 2, 3, 4, 5] + [0] * 7]
    assert step.paged.num_tokens == 9
    expected_slots = [blocks_table[p // 4] * 4 + p % 4 for blocks_table, positions in
                      ((prefilling.block_table, [4, 5, 6]), (scored.block_table, range(5)), (decoding.block_table, [5]))
                      for p in positions]
    assert step.paged.slot_mapping.tolist() == expected_slots
    # logits rows: the two sequences that reach their end sample (scored, then the decode), then
    # the scored prompt positions 0..3 (each predicts the next prompt token)
    assert [seq for seq, _ in step.sampled] == [scored, decoding]
    assert step.logits_indices.tolist() == [7, 8, 3, 4, 5, 6, 0, 0]  # padded to a bucket: rows nobody reads
    assert step.scored == [(scored, 0, 4)]


def test_engine_from_keywords_equals_engine_from_config():
    from minfer.engine.engine import Engine

    class Tokenizer:
        eos_token_id = None

    model = LlamaModel(TINY).eval()
    by_keywords = Engine(model, Tokenizer(), device="cpu", num_gpu_blocks_override=12, max_num_seqs=3)
    by_config = Engine(model, Tokenizer(), EngineConfig(device="cpu", num_gpu_blocks_override=12, max_num_seqs=3))
    assert dataclasses.asdict(by_keywords.config) == dataclasses.asdict(by_config.config)
    assert by_keywords.blocks.num_blocks == by_keywords.runner.pool.num_blocks == 12
    assert by_keywords.scheduler.max_num_seqs == 3
    with pytest.raises(TypeError, match="not both"):
        Engine(model, Tokenizer(), EngineConfig(), max_num_seqs=3)


def test_engine_flags_take_vllms_names_and_a_speculative_config():
    import argparse

    from minfer.config import add_engine_arguments, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--max-num-seqs", "4", "--no-enable-prefix-caching",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["max_num_seqs"] == 4 and kwargs["enable_prefix_caching"] is False
    config = EngineConfig.from_kwargs("serve", model="x", **kwargs)
    assert (config.speculative_model, config.num_speculative_tokens) == ("[ngram]", 2)
    assert "speculative_config" not in engine_kwargs_from_args(parser.parse_args([]))
    with pytest.raises(SystemExit):  # not JSON: argparse names the flag and exits
        parser.parse_args(["--speculative-config", "ngram"])
