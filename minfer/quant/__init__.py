"""Quantization: put smaller number formats into a loaded model, each module one job.

    schemes.py     the schemes (int8, int4, awq, gptq, nf4, fp8), one class each: quantize, stored layout, load
    linear.py      quantize_model, which puts a scheme's layers into a model, and byte counts
    int_linear.py  Int8Linear / Int4Linear, and which matmul backend runs them
    torch_ops.py   PyTorch's own CPU kernels for the formats, and the layout they need
    awq.py         activation-aware scales for int4 (AWQ's idea), folded into the float model
    gptq.py        GPTQ: int4 codes that make up for each other's rounding errors, layer by layer
    nf4.py         Nf4Linear: QLoRA's 4-bit NormalFloat weights, dequantized per matmul
    fp8_linear.py  Fp8Linear: e4m3 weights per output channel, fp8 matmuls (W8A8) or widened (W8A16)
    checkpoint.py  saved quantized checkpoints: write once, `LLM(folder)` loads them as stored
    gguf_q4_1.py   GGUF's Q4_1 blocks read from a file: the same group-wise int4 idea

Quantization-aware fine-tuning (train the float weights against their int4 rounding) is course code:
``minfer/lab/qat.py``.

The formats themselves (int8 per channel, int4 in groups, int8 KV entries) live in
``minfer/formats/``; the matmul kernels with the other kernels, in ``minfer/kernels/quant_matmul.py``;
the calibration text in ``minfer/texts.py``.
"""
from minfer.quant.linear import QUANTIZATION_METHODS, linear_weight_bytes, model_weight_bytes, quantize_model

__all__ = ["QUANTIZATION_METHODS", "linear_weight_bytes", "model_weight_bytes", "quantize_model"]
