"""The `quantization_config` entry of a saved quantized checkpoint's config.json: what the loader
(`minfer.models.loader`) checks when it reads one, and what `minfer.quant.checkpoint` writes.

The layout itself (which tensors, in which dtypes) is each scheme's (`minfer.quant.schemes`),
which also checks, when the model is built, that the entry's bits, group size and symmetry are
its own; this module is only the entry's common shape, so that loading a checkpoint needs
nothing of the quantizers.
"""
from __future__ import annotations

from typing import Optional

from minfer.config import QUANTIZATION_METHODS, allowed_group_sizes

QUANT_METHOD = "minfer"  # the quant_method of our layout (GPTQ's is "gptq")
FORMAT_VERSION = 1
CONFIG_KEYS = ("quant_method", "format_version", "method", "bits", "group_size", "sym", "desc_act", "head")
FLOAT_TENSORS = ("weight", "bias")  # the suffixes of the float model's tensors; every other one is quantized


def is_quantized_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a quantized matrix (codes, scales...: kept as stored). The float
    model's tensors are all parameters called weight or bias; a scheme's tensors never are."""
    return name.rsplit(".", 1)[-1] not in FLOAT_TENSORS


def quantization_config(method: str, bits: int, group_size: Optional[int], sym: bool, desc_act: bool,
                        head: Optional[str]) -> dict:
    """The `quantization_config` entry of config.json (a scheme fills it in: `QuantScheme.config_entry`)."""
    return {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "method": method, "bits": bits,
            "group_size": group_size, "sym": sym, "desc_act": desc_act, "head": head}


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
    if entry["method"] not in QUANTIZATION_METHODS:
        raise ValueError(f"{where}: method must be one of {QUANTIZATION_METHODS}, got {entry['method']!r}")
    if entry["group_size"] is not None and entry["group_size"] not in allowed_group_sizes(model_config):
        raise ValueError(f"{where}: group_size must be one of {allowed_group_sizes(model_config)} for this model "
                         f"(or null), got {entry['group_size']!r}")
    if entry["head"] not in ("int8", None) or not isinstance(entry["desc_act"], bool):
        raise ValueError(f"{where}: head must be 'int8' or null and desc_act true or false, got {entry['head']!r} "
                         f"and {entry['desc_act']!r}")
