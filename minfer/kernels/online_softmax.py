"""Online softmax: attention over a long row of keys, one tile at a time, in a single pass.

The problem
-----------
A query's attention output is ``softmax(s) @ V`` over its scores ``s`` against every visible key.
Computed the obvious way, that needs the whole row of scores at once (to find its maximum and
its sum) before the first value can be weighted: memory that grows with the context, and two
passes over the keys. Both attention kernels instead walk the keys in tiles of ``BLOCK_N``, and
only ever hold one tile of scores.

The running state
-----------------
Per query row the kernel keeps three things, updated after every tile:

    m    the largest score seen so far                     (starts at -inf)
    l    sum over the keys seen of exp(score - m)          (starts at 0)
    acc  sum over the keys seen of exp(score - m) * v      (starts at 0, one value row wide)

Subtracting the running maximum keeps every exponential at most 1, so nothing overflows, as in
any careful softmax. The catch is that ``m`` moves: when a new tile raises it to ``m'``, all of
``l`` and ``acc`` was summed with exp(score - m) where exp(score - m') is now wanted. Since

    exp(score - m') = exp(score - m) * exp(m - m')

one multiplication by ``alpha = exp(m - m')`` corrects everything accumulated so far, after
which the tile's own terms are added. When the keys run out, ``acc / l`` is exactly
softmax(scores) @ V, the same numbers the two-pass computation gives, up to rounding.

``online_softmax_update`` is that step, shared by ``paged_decode_attention.py`` (rows = the query
heads of one GQA group) and ``paged_prefill_attention.py`` (rows = a tile of query tokens). The
kernels differ in which scores they mask (past the context; in the future), not in this update.
The same rescaling merges partial results computed by different programs, which is how split-K
("flash decoding") parallelises a long context.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_update(m, l, acc, scores, v):
    """Fold one tile into the running softmax state; return the new ``(m, l, acc)``.

    m, l: [ROWS] float32; acc: [ROWS, D] float32; scores: [ROWS, BLOCK_N] float32, with -inf where a
    key must not be seen (past the context, or in a query's future); v: [BLOCK_N, D], the tile's
    values (masked keys must hold finite numbers: zeros, as ``load_kv_tile`` loads them).

    Precondition: the first tile gives every row at least one finite score (both kernels start at
    position 0, which every query sees). Then ``m_new`` is finite from that tile on, and the empty
    initial state is discarded cleanly by alpha = exp(-inf - m_new) = 0. A row that saw only -inf
    would compute exp(-inf - -inf) = NaN.
    """
    m_new = tl.maximum(m, tl.max(scores, axis=1))  # the running maximum, including this tile
    alpha = tl.exp(m - m_new)                      # rescales what was summed against the old maximum
    p = tl.exp(scores - m_new[:, None])            # this tile's weights; masked keys get exp(-inf) = 0
    l = l * alpha + tl.sum(p, axis=1)
    # p is cast to v's dtype because tl.dot wants both operands in one dtype (bfloat16/float16 on
    # tensor cores; the products are still summed in float32). input_precision="ieee": float32
    # operands stay float32 on a GPU, where tl.dot would otherwise round them to TF32 (10 mantissa
    # bits); it changes nothing for 16-bit operands.
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l, acc
