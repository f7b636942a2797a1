"""Saved quantized checkpoints (minfer/quant/checkpoint.py): quantize -> save -> load is exact, bad input is refused."""
import argparse
import json
import shutil

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.models.loader import load_model
from minfer.quant.checkpoint import (add_quantize_arguments, build_quantized_model, quantize_checkpoint, run_quantize,
                                     save_quantized)
from minfer.quant.schemes import SCHEMES

PROMPTS = ["The capital of France is", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method", list(SCHEMES))  # every scheme saves and loads
def test_round_trip_is_bit_identical_with_the_same_greedy_tokens(tiny_dir, tmp_path, method):
    group_size = 32 if SCHEMES[method].grouped else None
    out = quantize_checkpoint(tiny_dir, method, str(tmp_path / "ckpt"), group_size=group_size)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert config["method"] == method and config["bits"] == SCHEMES[method].bits
    # the checkpoint loads to exactly what the same quantization computes afresh at load time
    fresh = LLM(tiny_dir, quantization=method, quantization_group_size=group_size)
    reloaded = LLM(out)
    assert isinstance(reloaded.model.layers[0].mlp.down_proj, type(fresh.model.layers[0].mlp.down_proj))
    fresh_state, reloaded_state = fresh.model.state_dict(), reloaded.model.state_dict()
    assert fresh_state.keys() == reloaded_state.keys()
    for name in fresh_state:  # the CPU layouts both came from the same codes, scales and minimums
        assert torch.equal(fresh_state[name], reloaded_state[name]), name
    assert greedy_tokens(reloaded) == greedy_tokens(fresh)


def test_saved_tensors_are_those_of_the_quantized_model(tiny_dir, tmp_path):
    from minfer.models.llama import LlamaModel
    from minfer.quant.linear import quantize_model

    source = load_model(tiny_dir)
    model = LlamaModel.from_weights(source.config, source.weights)
    quantize_model(model, "int4", 32, backend="reference")
    save_quantized(model, str(tmp_path / "ckpt"), source.tokenizer)
    loaded = build_quantized_model(load_model(str(tmp_path / "ckpt")), backend="reference")
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert expected[name].dtype == got[name].dtype and torch.equal(expected[name], got[name]), name


@pytest.mark.slow
def test_real_model_int4_checkpoint_loads_to_the_same_greedy_tokens(tmp_path):
    out = quantize_checkpoint("smollm2-135m", "int4", str(tmp_path / "ckpt"))
    assert greedy_tokens(LLM(out)) == greedy_tokens(LLM("smollm2-135m", quantization="int4"))


def test_bad_arguments_name_what_is_allowed(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match=r"unknown quantization method 'fp4'.*'gptq'.*'nf4'"):
        quantize_checkpoint(tiny_dir, "fp4", str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"must be one of \[32, 64\]"):
        quantize_checkpoint(tiny_dir, "gptq", str(tmp_path / "b"), group_size=128)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an empty folder or a minfer quantized checkpoint"):
        quantize_checkpoint(tiny_dir, "int8", str(tmp_path / "busy"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json and \\*.safetensors"):
        LLM(str(tmp_path / "empty"))
    llm = LLM(tiny_dir, quantization="int4")  # on CPU: repacked for PyTorch's kernel, bfloat16 scales
    with pytest.raises(ValueError, match="backend='reference'"):
        save_quantized(llm, str(tmp_path / "c"))
    with pytest.raises(ValueError, match="not quantized"):
        save_quantized(LLM(tiny_dir), str(tmp_path / "d"))


@pytest.fixture(scope="module")
def int4_checkpoint(tiny_dir, tmp_path_factory) -> str:
    return quantize_checkpoint(tiny_dir, "int4", str(tmp_path_factory.mktemp("int4") / "ckpt"), group_size=32)


@pytest.mark.parametrize("change, message", [
    ({"quant_method": "gptq"}, "only its own quantized layout"),
    ({"group_size": 48}, r"group_size must be one of \[32, 64\]"),
    ({"bits": 8}, "must read"),
    ({"method": "fp4"}, r"method must be one of \('int8', 'int4', 'awq', 'gptq', 'nf4', 'fp8', 'gptq_fp8'\)"),
    ({"method": "nf4"}, r"'nf4' quantization_config must read .*'sym': True"),
    ({"method": "int8"}, r"'int8' quantization_config must read .*'group_size': None"),
    ({"extra": 1}, "exactly the keys"),
])
def test_malformed_quantization_config_is_refused(int4_checkpoint, tmp_path, change, message):
    folder = tmp_path / "ckpt"
    shutil.copytree(int4_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


@pytest.mark.parametrize("tensor, change, message", [
    ("lm_head.qweight", lambda t: t[:1000], r"lm_head.qweight is torch.int8 \(1000, 64\), expected torch.int8 \(\d+, 64\)"),
    ("model.layers.0.mlp.down_proj.qweight", lambda t: t.view(torch.int8), "down_proj.qweight is torch.int8"),
    ("model.layers.1.self_attn.qkv_proj.scale", lambda t: t[:-16], "qkv_proj.scale is torch.float16"),
])
def test_tensors_that_do_not_fit_the_config_are_refused(int4_checkpoint, tmp_path, tensor, change, message):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(int4_checkpoint, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors[tensor] = change(tensors[tensor]).contiguous()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


def test_a_checkpoint_written_over_keeps_none_of_the_old_files(tiny_dir, tmp_path):
    folder = tmp_path / "ckpt"
    quantize_checkpoint(tiny_dir, "int8", str(folder))
    # as a sentencepiece tokenizer (Llama 2's) would have left it: this model's tokenizer writes no such file
    (folder / "tokenizer.model").write_bytes(b"an earlier model's vocabulary")
    quantize_checkpoint(tiny_dir, "int4", str(folder), group_size=32)
    assert not (folder / "tokenizer.model").exists() and (folder / "tokenizer.json").exists()
    assert LLM(str(folder)).model.quantization["method"] == "int4"


def test_a_checkpoint_refuses_another_quantization(int4_checkpoint):
    with pytest.raises(ValueError, match=r"is a 'int4' checkpoint \(group size 32\)"):
        LLM(int4_checkpoint, quantization="int8")
    with pytest.raises(ValueError, match="no other group size"):
        LLM(int4_checkpoint, quantization="int4", quantization_group_size=64)


def test_the_quantize_command(tiny_dir, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_quantize_arguments(parser)
    assert run_quantize(parser.parse_args([tiny_dir, "--method", "int8", "--out", str(tmp_path / "ckpt")])) == 0
    assert "wrote" in capsys.readouterr().out
    assert LLM(str(tmp_path / "ckpt")).model.quantization["method"] == "int8"
    args = parser.parse_args([tiny_dir, "--method", "int4", "--group-size", "128", "--out", str(tmp_path / "x")])
    assert run_quantize(args) == 2
    assert "group size must be one of [32, 64]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([tiny_dir, "--method", "fp4", "--out", str(tmp_path / "y")])
