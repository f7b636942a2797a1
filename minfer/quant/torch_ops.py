"""The fastest quantized matmuls PyTorch itself offers on a CPU, and what they need.

PyTorch ships two weight-only kernels for CPUs (the ones torchao and gpt-fast call):

    torch.ops.aten._weight_int8pack_mm(x [M, K], q int8 [N, K], scale [N])                  x @ (q * s).T
    torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K], w, group_size, scale_and_zero)     x @ W.T, int4

Measured (torch 2.13, x86, one thread, a 3072x576 matrix):
- At batch 1, with bfloat16 activations, both are fast: each reads the small format and beats a bfloat16 or
  float32 dense matmul, as a memory-bound decode step should.
- With float32 activations both fall back to a generic loop about 20x slower than the dense
  float32 matmul. So a float32 model calls them with its activations cast to bfloat16, and casts
  the result back: the weights are already rounded far more coarsely than bfloat16 rounds x, and
  accumulation stays in float32 inside the kernel.
- Their time grows in step with the rows: a tiled loop unpacks the weights again for every few
  rows. The int8 one costs about 0.08 ms a row on that matrix, a float32 matmul about 0.05, so
  from INT8_DENSE_FROM_ROWS rows on (prefill, large batches) it is quicker to dequantize the int8
  matrix once and call the float32 matmul (at 512 rows: 25 ms against 43 ms;
  `benchmarks/bench_quant_matmul_cpu.py`). The int4 kernel's layout cannot be read back cheaply
  (``dequantize_int4_cpu``), so int4 keeps its kernel at every size.

The int4 kernel wants its own layout, not ours (``minfer.formats.weights``):
- the 4-bit values pre-tiled for its SIMD loops by ``_convert_weight_to_int4pack_for_cpu`` (from
  an int32 [N, K] matrix of 0..15), which requires N to be a multiple of 16;
- the group's parameters as ``scale_and_zero [K // group_size, N, 2]`` in the activation dtype,
  for the formula ``w = (q - 8) * scale + zero``. Ours is ``w = q * scale + min``, the same line
  written around a different origin: ``zero = min + 8 * scale``.
So a model prepared for this path stores the weights once, in the kernel's layout ("repacking",
as vLLM does after loading for whatever kernel it will run).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.formats.weights import dequantize_int8, unpack_int4

CPU_COMPUTE_DTYPE = torch.bfloat16
INT8_DENSE_FROM_ROWS = 64  # one AVX2 core: dense takes 0.91x the kernel's time at 64 rows, 1.24x at 32
INT4_CPU_INNER_K_TILES = 2  # the tiling torchao uses; the CPU kernel accepts 1, 2, 4 or 8


def int8_mm_cpu(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (q int8 [N, K] * scale [N]).T: PyTorch's CPU kernel on bfloat16 activations for
    fewer than INT8_DENSE_FROM_ROWS rows, else the dequantized matrix in a float32 matmul."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] >= INT8_DENSE_FROM_ROWS:
        out = F.linear(x2.float(), dequantize_int8(q, scale))
    else:
        out = torch.ops.aten._weight_int8pack_mm(x2.to(CPU_COMPUTE_DTYPE).contiguous(), q, scale.to(CPU_COMPUTE_DTYPE))
    return out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def int8_cpu_unsupported(in_features: int) -> str | None:
    """Why the CPU int8 kernel cannot take a layer of this shape, or None if it can. (Its loops read 16 inputs at
    a time with AVX-512, 8 with AVX2: other widths give wrong sums, NaN, or a crash; torch 2.13. Every multiple
    of 16 tried was right on both, so 16 is asked of every CPU.)"""
    if in_features % 16:
        return f"PyTorch's CPU int8 kernel needs in_features divisible by 16, got {in_features}"
    return None


def int4_cpu_unsupported(out_features: int) -> str | None:
    """Why the CPU int4 kernel cannot take a layer of this shape, or None if it can."""
    if out_features % 16:
        return f"PyTorch's CPU int4 kernel needs out_features divisible by 16, got {out_features}"
    return None


def pack_int4_for_cpu(packed: torch.Tensor, scale: torch.Tensor,
                      minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 format (see weights.py) -> (weight, scale_and_zero) in the CPU kernel's layout."""
    q = unpack_int4(packed).to(torch.int32)
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_CPU_INNER_K_TILES)
    scale32, min32 = scale.float(), minimum.float()
    scale_and_zero = torch.stack([scale32, min32 + 8 * scale32], dim=-1).transpose(0, 1)  # [groups, N, 2]
    return weight, scale_and_zero.to(CPU_COMPUTE_DTYPE).contiguous()


def int4_mm_cpu(x: torch.Tensor, weight: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [..., K] @ W.T with PyTorch's CPU int4 kernel (bfloat16 activations); weight from pack_int4_for_cpu."""
    x2 = x.reshape(-1, x.shape[-1]).to(CPU_COMPUTE_DTYPE).contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight, group_size, scale_and_zero)
    return out.to(x.dtype).reshape(*x.shape[:-1], scale_and_zero.shape[1])


def dequantize_int4_cpu(weight: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Read the float matrix [N, K] back out of the kernel's opaque layout: multiply the identity by it.

    Runs in float32 (the slow path, exact: each output is one weight times 1.0), for inspection only.
    """
    in_features = scale_and_zero.shape[0] * group_size
    eye = torch.eye(in_features, dtype=torch.float32, device=weight.device)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, weight, group_size, scale_and_zero.float()).T
