"""The `quantization_config` entry of a saved quantized checkpoint's config.json: what the loader
(`minfer.models.loader`) checks when it reads one, and what `minfer.quant.checkpoint` writes.

The layout itself (which tensors, in which dtypes) is described in `minfer.quant.checkpoint`;
this module is only the entry that says a folder holds it, so that loading a checkpoint needs
nothing of the quantizers.
"""
from __future__ import annotations

from typing import Optional

from minfer.config import INT4_METHODS, allowed_group_sizes

QUANT_METHOD = "minfer"  # the quant_method of our layout (GPTQ's is "gptq")
FORMAT_VERSION = 1
QUANTIZED_TENSORS = ("qweight", "scale", "minimum")  # the suffixes of tensors loaded exactly as stored
SAVED_METHODS = ("int8",) + INT4_METHODS  # nf4 (minfer.quant.nf4) has no saved layout yet
CONFIG_KEYS = ("quant_method", "format_version", "method", "bits", "group_size", "sym", "desc_act", "head")


def is_quantized_tensor(name: str) -> bool:
    """Whether a checkpoint tensor is a quantized matrix's codes, scale or minimum (kept as stored)."""
    return name.rsplit(".", 1)[-1] in QUANTIZED_TENSORS


def quantization_config(method: str, group_size: Optional[int], head: Optional[str], desc_act: bool = False) -> dict:
    """The `quantization_config` entry of config.json for a model quantized this way."""
    int4 = method in INT4_METHODS
    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "method": method,
            "bits": 4 if int4 else 8, "group_size": group_size if int4 else None, "sym": not int4,
            "desc_act": desc_act, "head": head}


def check_quantization_config(entry, model_config, where: str) -> None:
    """Raise a ValueError saying what is allowed if config.json's quantization_config is not ours or malformed."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: quantization_config must be an object, got {type(entry).__name__}")
    if entry.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{where}: quantization_config has quant_method {entry.get('quant_method')!r}; minfer loads "
                         f"only its own quantized layout (quant_method {QUANT_METHOD!r}, written by "
                         "`python -m minfer quantize`), not GPTQ/AWQ checkpoints of other tools")
    if sorted(entry) != sorted(CONFIG_KEYS):
        raise ValueError(f"{where}: quantization_config must have exactly the keys {list(CONFIG_KEYS)}, "
                         f"got {sorted(entry)}")
    if entry["format_version"] != FORMAT_VERSION:
        raise ValueError(f"{where}: format_version must be {FORMAT_VERSION}, got {entry['format_version']!r}")
    method = entry["method"]
    if method not in SAVED_METHODS:
        raise ValueError(f"{where}: method must be one of {SAVED_METHODS}, got {method!r}")
    if method in INT4_METHODS and entry["group_size"] not in allowed_group_sizes(model_config):
        raise ValueError(f"{where}: group_size must be one of {allowed_group_sizes(model_config)} for this model, "
                         f"got {entry['group_size']!r}")
    expected = quantization_config(method, entry["group_size"], entry["head"], entry["desc_act"])
    if entry["head"] not in ("int8", None) or not isinstance(entry["desc_act"], bool) or entry != expected:
        raise ValueError(f"{where}: a {method!r} quantization_config must read {expected} (head 'int8' or null, "
                         f"desc_act true or false), got {entry}")
