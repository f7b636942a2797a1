"""The quantization schemes, one small class each, and SCHEMES, the one table that lists them.

    scheme = get_scheme("int4")
    layer = scheme.quantize(linear, group_size=64, backend="auto")   # what `quantize_model` does per matrix
    scheme.layout(out_features, in_features, 64)                     # what a checkpoint stores for it
    layer = scheme.load(tensors, bias, backend="auto")               # and how it comes back

A scheme knows four things about one linear layer: how to quantize it, which tensors (names,
shapes, dtypes) a saved checkpoint holds for it, how to build the layer again from those tensors,
and what its checkpoint's `quantization_config` says (bits, group size, symmetric or not). Some
schemes also work on the whole float model first (`prepare`): AWQ folds activation-aware scales
into it, GPTQ chooses every matrix's codes layer by layer. A new scheme is a class here and one
line in SCHEMES; `quantize_model`, `save_quantized` and `build_quantized_model` need no change.

``minfer.config.QUANTIZATION_METHODS`` repeats the names so that `EngineConfig` can check them
before anything is loaded (that module sits below this one and cannot import it);
tests/test_quant_schemes.py keeps the two the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from minfer.models.quantization_config import quantization_config
from minfer.quant.awq import CLIP_LINEARS, apply_awq
from minfer.quant.fp8_linear import Fp8Linear
from minfer.quant.gptq import apply_gptq
from minfer.quant.int_linear import Int4Linear, Int8Linear
from minfer.quant.nf4 import Nf4Linear

# How "gptq" runs, chosen by measurement (SmolLM2-135M, int4 g64, perplexity increase: plain GPTQ +16.8 %,
# with activation order +9.0 %, after AWQ's scales +8.4 %, both +6.1 %, both and AWQ's clipping +8.1 %;
# docs/benchmarks.md): after AWQ's activation-aware scales (without its clipping), in activation order.
GPTQ_AFTER_AWQ_SCALES = True
GPTQ_DESC_ACT = True
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # {tensor suffix: (shape, dtype)}, in the order load reads them


@dataclass
class Prepared:
    """What a scheme computed on the whole float model before its matrices are replaced."""

    codes: dict[tuple[int, str], tuple[torch.Tensor, ...]] = field(default_factory=dict)  # per (layer, matrix)
    desc_act: bool = False  # the codes were chosen in activation order (GPTQ); a checkpoint's config says so


class QuantScheme:
    """One way to store a linear layer's weight in fewer bits. The base class is per-channel int8."""

    name = "int8"
    bits = 8
    grouped = False  # one scale per group of group_size inputs (quantization_group_size applies)
    symmetric = True  # no offset: the weight is code x scale
    calibrated = False  # needs calibration_token_ids (runs the float model on calibration text)

    def prepare(self, model: nn.Module, group_size: Optional[int], calibration_token_ids: Optional[Sequence[int]],
                **options: bool) -> Prepared:
        """Work on the whole float model before any matrix is replaced. options: GPTQ's (gptq_after_awq,
        gptq_desc_act); other schemes have none and ignore them."""
        return Prepared()

    def quantize(self, linear: nn.Linear, group_size: Optional[int], backend: str,
                 codes: Optional[tuple[torch.Tensor, ...]] = None) -> nn.Module:
        """The quantized layer for one float matrix (codes: those `prepare` chose for it, if any)."""
        return Int8Linear.from_linear(linear, backend)

    def layout(self, out_features: int, in_features: int, group_size: Optional[int]) -> Layout:
        """The tensors a checkpoint stores for one matrix, {suffix: (shape, dtype)}."""
        return {"qweight": ((out_features, in_features), torch.int8), "scale": ((out_features,), torch.float32)}

    def load(self, tensors: dict[str, torch.Tensor], bias: Optional[nn.Parameter], backend: str) -> nn.Module:
        """The layer again, from the tensors of `layout` as a checkpoint stored them."""
        return Int8Linear(tensors["qweight"], tensors["scale"], bias, backend)

    def unsavable(self, layer: nn.Module) -> Optional[str]:
        """Why this quantized layer cannot be saved exactly as it is, or None."""
        return None

    def config_entry(self, group_size: Optional[int], head: Optional[str], desc_act: bool = False) -> dict:
        """The `quantization_config` of config.json for a model quantized with this scheme."""
        return quantization_config(self.name, self.bits, group_size if self.grouped else None, self.symmetric,
                                   desc_act, head)


class Int4Scheme(QuantScheme):
    """int4 round-to-nearest in groups of group_size inputs, a float16 scale and minimum each."""

    name, bits, grouped, symmetric = "int4", 4, True, False

    def quantize(self, linear, group_size, backend, codes=None):
        if codes is not None:  # chosen by `prepare` (GPTQ)
            return Int4Linear.from_packed(*codes, linear.bias, backend)
        return Int4Linear.from_linear(linear, group_size, backend)

    def layout(self, out_features, in_features, group_size):
        groups = (out_features, in_features // group_size)
        return {"qweight": ((out_features, in_features // 2), torch.uint8), "scale": (groups, torch.float16),
                "minimum": (groups, torch.float16)}

    def load(self, tensors, bias, backend):
        return Int4Linear.from_packed(tensors["qweight"], tensors["scale"], tensors["minimum"], bias, backend)

    def unsavable(self, layer):
        if layer.backend == "torch":
            return ("holds PyTorch's CPU-kernel layout, whose bfloat16 scales cannot be saved exactly: quantize with "
                    "backend='reference' (quantize_checkpoint or `python -m minfer quantize` does)")
        return None


class AwqScheme(Int4Scheme):
    """int4 after activation-aware scales are folded into the float model (`minfer.quant.awq`)."""

    name, calibrated = "awq", True

    def prepare(self, model, group_size, calibration_token_ids, **options):
        apply_awq(model, calibration_token_ids, group_size, clip_linears=CLIP_LINEARS)
        return Prepared()


class GptqScheme(Int4Scheme):
    """int4 whose codes make up for each other's rounding errors (`minfer.quant.gptq`)."""

    name, calibrated = "gptq", True

    def prepare(self, model, group_size, calibration_token_ids, gptq_after_awq: bool = GPTQ_AFTER_AWQ_SCALES,
                gptq_desc_act: bool = GPTQ_DESC_ACT, **options):
        if gptq_after_awq:  # without clipping: GPTQ's error feedback does what clipping does for round-to-nearest
            apply_awq(model, calibration_token_ids, group_size, clip_linears=())
        codes = apply_gptq(model, calibration_token_ids, group_size, desc_act=gptq_desc_act)
        return Prepared(codes, desc_act=gptq_desc_act)


class Nf4Scheme(QuantScheme):
    """QLoRA's 4-bit NormalFloat, an absmax per block of group_size inputs (`minfer.quant.nf4`)."""

    name, bits, grouped, symmetric = "nf4", 4, True, True

    def quantize(self, linear, group_size, backend, codes=None):
        return Nf4Linear.from_linear(linear, group_size)  # one matmul on every backend: dequantize, then multiply

    def layout(self, out_features, in_features, group_size):
        return {"qweight": ((out_features, in_features // 2), torch.uint8),
                "absmax": ((out_features, in_features // group_size), torch.float16)}

    def load(self, tensors, bias, backend):
        return Nf4Linear(tensors["qweight"], tensors["absmax"], bias)


class Fp8Scheme(QuantScheme):
    """fp8 e4m3 per output channel (`minfer.quant.fp8_linear`): fp8 matmuls on GPUs that have them, else the
    weights widened to the activations' dtype."""

    name = "fp8"

    def quantize(self, linear, group_size, backend, codes=None):
        if codes is not None:  # chosen by `prepare` (GPTQ)
            return Fp8Linear(*codes, linear.bias, backend)
        return Fp8Linear.from_linear(linear, backend)

    def layout(self, out_features, in_features, group_size):
        return {"qweight": ((out_features, in_features), torch.float8_e4m3fn), "scale": ((out_features,), torch.float32)}

    def load(self, tensors, bias, backend):
        return Fp8Linear(tensors["qweight"], tensors["scale"], bias, backend)


class GptqFp8Scheme(Fp8Scheme):
    """The fp8 format with GPTQ's choice of values (`minfer.quant.gptq`, `gptq_quantize_fp8`): the same layers and
    checkpoints as "fp8", whose rows are rounded to nearest."""

    name, calibrated = "gptq_fp8", True

    def prepare(self, model, group_size, calibration_token_ids, gptq_desc_act: bool = GPTQ_DESC_ACT, **options):
        return Prepared(apply_gptq(model, calibration_token_ids, None, desc_act=gptq_desc_act, fp8=True),
                        desc_act=gptq_desc_act)


# The one list of schemes, by name, in the order messages list them.
SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (QuantScheme(), Int4Scheme(), AwqScheme(), GptqScheme(),
                                                       Nf4Scheme(), Fp8Scheme(), GptqFp8Scheme())}
HEAD_SCHEME = SCHEMES["int8"]  # the output head of every scheme (head="int8"): its errors land on the logits
CALIBRATED_METHODS = tuple(name for name, s in SCHEMES.items() if s.calibrated)


def get_scheme(name: str) -> QuantScheme:
    """The scheme called `name`; a ValueError lists the known ones."""
    if name not in SCHEMES:
        raise ValueError(f"unknown quantization method {name!r}: use one of {tuple(SCHEMES)}")
    return SCHEMES[name]
