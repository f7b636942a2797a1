"""GGUF's Q4_1 format, read from a model file: group-wise asymmetric int4 with groups of 32.

The SmolLM2 file minfer ships is ``SmolLM2-135M-Instruct.Q4_1.gguf``: llama.cpp stored nearly every
matrix of it as Q4_1 (the token embedding as Q8_0). A Q4_1 tensor is a sequence of 20-byte blocks,
each covering 32 consecutive weights of one row (along the input dimension):

    bytes 0-1    d   float16, the step (our ``scale``)
    bytes 2-3    m   float16, the group's minimum (our ``minimum``)
    bytes 4-19   qs  32 values of 4 bits: weight j (0..15) in the low nibble of byte j,
                     weight j + 16 in the high nibble

    weight = d * q + m                      (5 bits per weight: 4 + 32 bits of d and m per 32)

That is exactly ``minfer.formats.weights``' int4 with group_size 32, except for where the nibbles
sit (GGUF pairs weight j with j + 16; we pair 2i with 2i + 1). So int4 g32, applied to weights
that came out of this file, finds the same groups and can reproduce the stored numbers almost
exactly: a flattering baseline. Honest int4 numbers use groups of 64 or 128 on this model, or a
model whose weights were never quantized.
"""
from __future__ import annotations

import numpy as np
import torch

from minfer.formats.gguf_file import Q4_1_BLOCK_BYTES, Q4_1_GROUP, GGUFTensor, q4_1_fields, read_gguf_file
from minfer.formats.weights import quantize_int4_groupwise


def _tensor(path: str, name: str) -> GGUFTensor:
    from gguf import GGMLQuantizationType

    tensor = read_gguf_file(path).tensors.get(name)
    if tensor is None:
        raise ValueError(f"no tensor {name!r} in {path}")
    if tensor.type != GGMLQuantizationType.Q4_1:
        raise ValueError(f"tensor {name!r} is {GGMLQuantizationType(tensor.type).name}, not Q4_1")
    return tensor


def read_q4_1(path: str, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor of a GGUF file, decoded: (q uint8 [rows, cols] 0..15, d float16 [rows, cols // 32], m float16).

    The tensor's rows are the weight's output rows, in the file's order (llama.cpp permutes the
    rows of q and k for its RoPE layout; nothing else).
    """
    q, d, m = q4_1_fields(np.asarray(_tensor(path, name).data))  # from [rows, blocks * 20] uint8
    return torch.from_numpy(q.copy()), torch.from_numpy(d.copy()), torch.from_numpy(m.copy())


def q4_1_block(path: str, name: str, row: int = 0, block: int = 0) -> dict:
    """One 20-byte block: its raw bytes, d, m, the 32 codes and the 32 weights d * q + m (float32)."""
    raw = np.asarray(_tensor(path, name).data)
    rows, blocks = raw.shape[0], raw.shape[1] // Q4_1_BLOCK_BYTES
    if not (0 <= row < rows and 0 <= block < blocks):
        raise ValueError(f"{name} has {rows} rows of {blocks} Q4_1 blocks: row must be in [0, {rows}) and block in "
                         f"[0, {blocks}), got row={row}, block={block}")
    data = raw[row, block * Q4_1_BLOCK_BYTES:(block + 1) * Q4_1_BLOCK_BYTES].tobytes()
    d, m = np.frombuffer(data[0:4], dtype=np.float16)
    qs = np.frombuffer(data[4:], dtype=np.uint8)
    q = np.concatenate([qs & 0xF, qs >> 4])
    values = np.float32(d) * q.astype(np.float32) + np.float32(m)
    return {"raw": data, "d": float(d), "m": float(m), "q": q, "values": values}


def requantize_agreement(path: str, name: str) -> dict:
    """Rebuild a Q4_1 tensor's float weights, quantize them with our int4 g32, and compare the two.

    Returns the share of codes, scales and minimums that come out identical, and the largest
    difference between the two sets of reconstructed weights.
    """
    q, d, m = read_q4_1(path, name)
    rows, cols = q.shape
    weights = (q.float().view(rows, -1, Q4_1_GROUP) * d.float()[..., None] + m.float()[..., None]).view(rows, cols)
    q2, scale, minimum = quantize_int4_groupwise(weights, Q4_1_GROUP)
    rebuilt = (q2.float().view(rows, -1, Q4_1_GROUP) * scale.float()[..., None]
               + minimum.float()[..., None]).view(rows, cols)
    return {"codes_equal": (q2 == q).float().mean().item(), "scales_equal": (scale == d).float().mean().item(),
            "minimums_equal": (minimum == m).float().mean().item(),
            "max_weight_difference": (rebuilt - weights).abs().max().item(),
            "max_weight": weights.abs().max().item()}
