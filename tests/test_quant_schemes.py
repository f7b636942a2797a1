"""The scheme registry (minfer/quant/schemes.py): every scheme stores what it declares and loads back exactly,
an unknown name is refused with the known ones, and the registry is the one list of schemes."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from minfer.config import GROUPED_METHODS, INT4_METHODS, QUANTIZATION_METHODS
from minfer.models.llama import LlamaModel
from minfer.models.quantization_config import check_quantization_config, is_quantized_tensor
from minfer.quant.checkpoint import build_quantized_model
from minfer.quant.linear import quantize_model
from minfer.quant.schemes import SCHEMES, get_scheme
from minfer.lab.testing import tiny_llama

ROOT = Path(__file__).resolve().parents[1]


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown quantization method 'fp4': use one of \('int8', 'int4', 'awq', "
                                         r"'gptq', 'nf4', 'fp8', 'gptq_fp8'\)"):
        get_scheme("fp4")
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_model(tiny_llama(), "int3")


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_layer_stores_its_layout_and_loads_back_exactly(name, backend):
    scheme = get_scheme(name)
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(128, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 128, generator=gen) * 0.05)
    group_size = 32 if scheme.grouped else None
    codes = None
    if name == "gptq":  # GPTQ's codes come from its `prepare`; any int4 codes of the right layout will do here
        q = get_scheme("int4").quantize(linear, 32, "reference")
        codes = (q.qweight, q.scale, q.minimum)
    layer = scheme.quantize(linear, group_size, "reference", codes)
    layout = scheme.layout(48, 128, group_size)
    buffers = dict(layer.named_buffers())
    assert list(buffers) == list(layout)  # the layer's tensors are the checkpoint's, none more, none less
    for part, (shape, dtype) in layout.items():
        assert tuple(buffers[part].shape) == shape and buffers[part].dtype == dtype, part
        assert is_quantized_tensor(f"model.layers.0.mlp.down_proj.{part}")
    reloaded = scheme.load({part: t.clone() for part, t in buffers.items()}, linear.bias, backend)
    fresh = scheme.load(buffers, linear.bias, backend)  # the same tensors through the same backend
    x = torch.randn(5, 128, generator=gen)
    assert torch.equal(reloaded(x), fresh(x))
    if backend == "reference":
        assert torch.equal(reloaded(x), layer(x))
    else:  # PyTorch's CPU kernels take bfloat16 activations
        torch.testing.assert_close(reloaded(x), layer(x), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_saves_and_loads_a_model_to_identical_logits(name, tmp_path, tiny_dir):
    from minfer.models.loader import load_model
    from minfer.quant.checkpoint import save_quantized
    from minfer.texts import calibration_token_ids

    source = load_model(tiny_dir)
    model = LlamaModel.from_weights(source.config, source.weights)
    scheme = get_scheme(name)
    calibration = calibration_token_ids(source.tokenizer) if scheme.calibrated else None
    quantize_model(model, name, 32 if scheme.grouped else None, backend="reference", calibration_token_ids=calibration)
    save_quantized(model, str(tmp_path / name), source.tokenizer)
    loaded = load_model(str(tmp_path / name))
    assert loaded.quantization == scheme.config_entry(model.quantization["group_size"], "int8",
                                                      model.quantization["desc_act"])
    reloaded = build_quantized_model(loaded, backend="reference")
    ids = torch.arange(3, 30)[None]
    positions = torch.arange(ids.shape[1])[None]
    assert torch.equal(reloaded(ids, positions, last_only=False), model(ids, positions, last_only=False))


def test_the_entry_is_checked_by_its_scheme():
    config = dataclasses.replace(tiny_llama().config, intermediate_size=64)  # group size 32 divides every input
    entry = get_scheme("nf4").config_entry(32, "int8")
    check_quantization_config(entry, config, "here")  # the common shape: accepted
    assert entry["bits"] == 4 and entry["sym"] is True and entry["group_size"] == 32
    assert get_scheme("int8").config_entry(32, None)["group_size"] is None  # int8 has no groups


def test_config_names_the_same_schemes():
    """EngineConfig checks names before loading, from a module below minfer.quant: its tuples must be the registry's."""
    assert QUANTIZATION_METHODS == tuple(SCHEMES)
    assert GROUPED_METHODS == tuple(n for n, s in SCHEMES.items() if s.grouped)
    assert INT4_METHODS == tuple(n for n, s in SCHEMES.items() if s.grouped and not s.symmetric)


# The library modules that quantize, save, load and serve: none may list scheme names or compare a method with one.
DISPATCHERS = [*sorted((ROOT / "minfer" / "quant").glob("*.py")), *sorted((ROOT / "minfer" / "models").glob("*.py")),
               *sorted((ROOT / "minfer" / "engine").glob("*.py")), ROOT / "minfer" / "llm.py"]


def _scheme_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and node.value in SCHEMES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [elt.value for elt in node.elts if isinstance(elt, ast.Constant) and elt.value in SCHEMES]
    return []


def scheme_lists(source: str) -> list[int]:
    """Lines that list two or more scheme names, or compare a method (or quantization) with scheme names. ("int8"
    alone is also the output head's format and a KV cache dtype: those comparisons are not about schemes.)"""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(_scheme_names(node)) >= 2:
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(_scheme_names(side) for side in [node.left, *node.comparators]):
            if any(word in ast.unparse(node).lower() for word in ("method", "quantization")):
                lines.append(node.lineno)
    return lines


def test_the_check_finds_lists_and_comparisons():
    assert scheme_lists('x = ("int4", "awq")\nif method == "gptq": pass\nif config.quantization in ("nf4",): pass\n'
                        'f("int8")\nif head == "int8": pass\n') == [1, 2, 3]


def test_the_registry_is_the_only_list():
    found = [f"{path.relative_to(ROOT)}:{line}" for path in DISPATCHERS if path.name != "schemes.py"
             for line in scheme_lists(path.read_text())]
    assert not found, "scheme names listed or compared outside minfer/quant/schemes.py (ask the registry):\n  " + \
        "\n  ".join(found)
