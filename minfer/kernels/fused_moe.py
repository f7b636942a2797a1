"""Mixture-of-experts MLP as two grouped matmuls: the idea of vLLM's ``fused_moe``.

The problem
-----------
Each of T tokens goes to k of E experts (``expert_ids [T, k]``, with mixing ``weights [T, k]``),
and each expert is a SwiGLU MLP with its own matrices (``gate_up [E, 2F, D]``, ``down [E, D, F]``):

    out[t] = sum_j weights[t, j] * down_e (silu(gate_e x_t) * up_e x_t),   e = expert_ids[t, j]

The reference
-------------
``fused_moe_reference`` loops over the experts: find the (token, slot) pairs routed to expert e,
gather their rows, run the expert's two matmuls, scale by the weights, add into the output. Right,
and differentiable, but it launches ~6 small kernels per expert: with 64 or 128 experts and a
decode step of a few tokens, the launches and the searches cost more than the arithmetic.

The kernels
-----------
Line the T * k token-expert pairs up by expert once (``align_by_expert``), and pad each expert's
run to a multiple of the tile height BLOCK_M with an invalid pair id:

    pairs by expert:  [e0 e0 e0 -- | e2 -- -- -- | e3 e3 e3 e3 | e3 -- -- --]     (BLOCK_M = 4)
    block_experts:    [    0       |      2      |      3      |      3     ]

Every tile of BLOCK_M rows now belongs to one expert. One launch covers all of them: program
(m, n) reads its tile's expert from ``block_experts[m]``, gathers its pairs' token rows of x, and
multiplies them by that expert's weight tile; experts with no tokens get no tiles and their
weights are never read. That is a *grouped* matmul: many independent matmuls of different
heights in one launch. Two launches make the MLP:

    1. gate/up: h[pair] = silu(x[token] @ gate_e.T) * (x[token] @ up_e.T)     [T*k, F], x's dtype
    2. down:    y[pair] = weight[pair] * (h[pair] @ down_e.T)                 [T*k, D], float32

and the combine sums each token's k rows of y (a reshape and a sum; vLLM's ``moe_sum``).
Both kernels write rows by pair id, so nothing needs un-sorting. The padding costs at most
BLOCK_M - 1 wasted rows per used expert; the tile height trades that against weight reuse (a
weight tile is read once per BLOCK_M rows).

As in ``quant_matmul.py``, float32 operands use ``input_precision="ieee"``: on a GPU ``tl.dot``
would otherwise round them to TF32. vLLM also computes the padding on the GPU with a kernel of
its own and fuses the routing weights into the first launch when k = 1; here the alignment is a
few PyTorch ops, with no host synchronisation: the grid is sized for the worst case, and the
tiles past the last expert's run see expert -1 and return at once.

``fused_moe`` runs the kernels on CUDA tensors or under TRITON_INTERPRET=1 (see
``paged_cache.py``), and otherwise falls back to the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minfer.kernels.paged_cache import use_triton
from minfer.kernels.quant_matmul import matmul_warps


def fused_moe_reference(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor) -> torch.Tensor:
    """x [T, D], weights/expert_ids [T, k], gate_up [E, 2F, D], down [E, D, F] -> [T, D] in x's dtype.

    For each expert, the (token, slot) pairs routed to it; their outputs added in, in float32.
    Out of place throughout, so that autograd runs through it (training a tiny MoE uses it)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        tokens, slots = torch.where(expert_ids == e)
        if tokens.numel() == 0:
            continue
        gate, up = F.linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out = out.index_add(0, tokens, y.float() * weights[tokens, slots, None].float())
    return out.to(x.dtype)


def align_by_expert_reference(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """Plain Python: pair ids (t * k + j) expert by expert, each run padded with -1 to a multiple of
    block_m, and the expert of each block of block_m (unused experts get no block)."""
    flat = expert_ids.reshape(-1).tolist()
    pairs, blocks = [], []
    for e in range(num_experts):
        run = [p for p, chosen in enumerate(flat) if chosen == e]
        if run:
            run += [-1] * (-len(run) % block_m)
            pairs += run
            blocks += [e] * (len(run) // block_m)
    return pairs, blocks


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align_by_expert_reference`` in tensor ops on the device, without a host sync: sized for the
    worst case, the unused tail of the pair list is -1 and its blocks' expert is -1.

    Returns (sorted_pairs int32 [max_blocks * block_m], block_experts int32 [max_blocks])."""
    flat = expert_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)  # each used expert wastes < 1 block
    # (not torch.bincount: on CUDA it reads the ids' min and max back to the host, two syncs per layer)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # pair ids, expert by expert, in token order within each
    by_expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    sorted_pairs = torch.full((max_blocks * block_m,), -1, dtype=torch.int32, device=flat.device)
    sorted_pairs[(padded_end - padded)[by_expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)  # the run each block falls in
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_pairs, block_experts


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, pairs_ptr, block_experts_ptr, h_ptr, F, D,
                        stride_xt, stride_we, stride_wn, stride_hp,
                        TOP_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:  # a tile past the last expert's run: the grid is sized for the worst case
        return
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs >= 0
    tokens = tl.where(row_ok, pairs, 0) // TOP_K  # the pair's token row of x
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of h: gate rows cols, up rows F + cols
    col_ok = cols < F
    w = w_ptr + expert.to(tl.int64) * stride_we  # this tile's expert: picked from the sorted order
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, D, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w + (F + cols)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        gate += tl.dot(a, wg, input_precision="ieee")  # float32 stays float32; 16-bit: no change
        up += tl.dot(a, wu, input_precision="ieee")
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, in float32
    tl.store(h_ptr + pairs[:, None].to(tl.int64) * stride_hp + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, pairs_ptr, block_experts_ptr, weights_ptr, y_ptr, D, F,
                     stride_hp, stride_we, stride_wn, stride_yp,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs >= 0
    rows = tl.where(row_ok, pairs, 0).to(tl.int64)  # h and y are indexed by pair
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    col_ok = cols < D
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, F, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < F
        a = tl.load(h_ptr + rows[:, None] * stride_hp + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wd = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, wd, input_precision="ieee")
    acc *= tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]  # the routing weight of each pair
    tl.store(y_ptr + rows[:, None] * stride_yp + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def moe_gate_up(x: torch.Tensor, gate_up: torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
                top_k: int, *, block_m: int = 16, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """Launch 1: h [T * k, F] = silu(x[token] @ gate.T) * (x[token] @ up.T), each pair by its expert."""
    num_experts, two_f, hidden = gate_up.shape
    h = torch.empty(x.shape[0] * top_k, two_f // 2, dtype=x.dtype, device=x.device)
    grid = (block_experts.numel(), triton.cdiv(two_f // 2, block_n))
    _moe_gate_up_kernel[grid](x, gate_up, sorted_pairs, block_experts, h, two_f // 2, hidden,
                              x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
                              TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, num_warps=matmul_warps(x.dtype))
    return h


def moe_down(h: torch.Tensor, down: torch.Tensor, sorted_pairs: torch.Tensor, block_experts: torch.Tensor,
             pair_weights: torch.Tensor, *, block_m: int = 16, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """Launch 2: y [T * k, D] float32 = weight[pair] * (h[pair] @ down.T), each pair by its expert."""
    num_experts, hidden, intermediate = down.shape
    y = torch.empty(h.shape[0], hidden, dtype=torch.float32, device=h.device)
    grid = (block_experts.numel(), triton.cdiv(hidden, block_n))
    _moe_down_kernel[grid](h, down, sorted_pairs, block_experts, pair_weights, y, hidden, intermediate,
                           h.stride(0), down.stride(0), down.stride(1), y.stride(0),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           num_warps=matmul_warps(h.dtype))
    return y


def fused_moe(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, *, block_m: int = 16) -> torch.Tensor:
    """The Triton kernels for ``fused_moe_reference`` (same arguments, same result within float rounding).

    block_m: the tile height, a power of two >= 16. Falls back to the reference off CUDA without
    TRITON_INTERPRET=1."""
    if not use_triton(x):
        return fused_moe_reference(x, weights, expert_ids, gate_up, down)
    num_tokens, top_k = expert_ids.shape
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    sorted_pairs, block_experts = align_by_expert(expert_ids, gate_up.shape[0], block_m)
    h = moe_gate_up(x, gate_up, sorted_pairs, block_experts, top_k, block_m=block_m)
    y = moe_down(h, down, sorted_pairs, block_experts, weights.reshape(-1).float().contiguous(), block_m=block_m)
    return y.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)  # the combine: each token's k weighted rows
