"""The paged KV cache as the model sees it during one engine step.

`KVPool` holds the memory: per layer a K pool and a V pool cut into blocks of `block_size`
tokens. Token t of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`; its flat *slot* is block * block_size + offset. The pools hold the model's dtype
(kv_cache_dtype "auto"), int8 ("int8": a float32 scale per (token, KV head) sits beside them) or
float8_e4m3fn ("fp8": a float32 scale per (layer, KV head), calibrated once); tokens are quantized
as they are stored and dequantized as they are read (`minfer/formats/kv.py`), and the same memory
holds about twice as many tokens as bfloat16.

In memory the pools are heads-first, [layers, kv_heads, num_blocks, block_size, head_dim], so one
KV head's tokens of a block are one contiguous run. Every reader sees a layer's pool as
[num_blocks, block_size, kv_heads, head_dim] (`layer`), a view whose strides the Triton kernels
take as they come; copying a sequence's blocks out (`gather_blocks`) then gives each
(head, sequence) pair one contiguous row, which is what a CPU matmul wants. The scale pools stay
[layers, num_blocks, block_size, kv_heads]: the kernels read a token's scales side by side.

`PagedStep` describes one step's batch: the new tokens of every scheduled sequence packed
into one row (prefill chunks first, then one token per decoding sequence), where each
sequence's tokens go (slot mapping), and what each sequence may look at (its block table and
context length). The model hands every layer's q, k, v to `PagedStep.attend`, which stores the
new k, v in their slots and runs attention over each sequence's whole context.

On CPU, attention copies each sequence's blocks out of the pool into a reused buffer and calls
the model's attention function (the same contract as the contiguous cache: mask None means causal
with the queries last). Decoding sequences come sorted by context length and are served a few
at a time (`decode_groups`): one call per group of similar lengths pads less than one call for
all. On CUDA the Triton kernels of `minfer.kernels` read the pool through the block tables instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minfer.config import ModelConfig
from minfer.engine.buckets import bucket_for
from minfer.formats.hardware import check_fp8_supported
from minfer.host_copy import to_device
from minfer.formats.kv import FP8_DTYPE, check_kv_cache_dtype, dequantize_kv, fp8_scale, quantize_kv, quantize_kv_fp8
from minfer.kernels.paged_cache import gather_blocks, slots_for_positions
from minfer.layers.attention import AttentionFn


class KVPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, kv_cache_dtype: str = "auto") -> None:
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        self.int8 = self.kv_cache_dtype == "int8"  # a scale per (token, KV head)
        self.fp8 = self.kv_cache_dtype == "fp8"  # a scale per (layer, KV head)
        if self.fp8:
            check_fp8_supported(device)
        self.dtype = dtype  # the model's: what reads return
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (config.num_layers, config.num_kv_heads, num_blocks, block_size, config.head_dim)  # heads-first
        pool_dtype = torch.int8 if self.int8 else FP8_DTYPE if self.fp8 else dtype
        self.k = torch.zeros(shape, dtype=pool_dtype, device=device)
        self.v = torch.zeros_like(self.k)
        # int8: one float32 scale per (layer, block, offset, KV head); fp8: one per (layer, KV head),
        # 1 (vLLM's default) until `calibrate_fp8` sets them from measured ranges
        scale_shape = ((config.num_layers, num_blocks, block_size, config.num_kv_heads) if self.int8
                       else (config.num_layers, config.num_kv_heads))
        scaled = self.int8 or self.fp8
        self.k_scale = torch.ones(scale_shape, dtype=torch.float32, device=device) if scaled else None
        self.v_scale = torch.ones_like(self.k_scale) if scaled else None
        self._workspace = torch.empty(0, dtype=self.k.dtype, device=device)  # reused by `gather`

    @property
    def nbytes(self) -> int:
        """The pools' bytes, per-token scales included (fp8's per-head scales are a few bytes, not counted)."""
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.int8 else 0
        return self.k.nbytes + self.v.nbytes + scales

    def calibrate_fp8(self, k_amax: torch.Tensor, v_amax: torch.Tensor) -> None:
        """Set an fp8 pool's scales from the largest |k| and |v| seen per (layer, KV head) (`fp8_scale`).
        Only before anything is stored: tokens already stored were scaled by the old scales."""
        if not self.fp8:
            raise ValueError(f"calibrate_fp8 is for an fp8 pool; this one is {self.kv_cache_dtype!r}")
        self.k_scale.copy_(fp8_scale(k_amax))
        self.v_scale.copy_(fp8_scale(v_amax))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pools as every reader sees them: [num_blocks, block_size, kv_heads, head_dim] views."""
        return self.k[layer].movedim(0, 2), self.v[layer].movedim(0, 2)

    def scales(self, layer: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The layer's K and V scales: int8 pools' scale pools [num_blocks, block_size, kv_heads], fp8
        pools' per-head scales [kv_heads], or (None, None)."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.k_scale is not None else (None, None)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write k, v [tokens, kv_heads, head_dim] at their slots (quantizing them for an int8 or fp8 pool)."""
        for pool, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if self.int8:
                new, scale = quantize_kv(new)  # int8 [tokens, kv_heads, head_dim], float32 [tokens, kv_heads]
                scales[layer].view(-1, new.shape[1])[slots] = scale
            elif self.fp8:
                new = quantize_kv_fp8(new, scales[layer])
            pool[layer].view(new.shape[1], -1, new.shape[2])[:, slots] = new.transpose(0, 1)

    def _read(self, values: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
        """Stored values [seqs, kv_heads, tokens, head_dim] in the model's dtype, given their per-token
        scales [seqs, kv_heads, tokens] (int8) or the layer's per-head scales [kv_heads] (fp8)."""
        if self.fp8:
            scales = scales[None, :, None].expand(values.shape[:-1])
        return values if scales is None else dequantize_kv(values, scales, self.dtype)

    def gather(self, layer: int, tables: torch.Tensor, first_block: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks, [seqs, kv_heads, blocks * block_size, head_dim], in the model's dtype.

        They are views of a buffer the next call overwrites: use them before gathering again.
        first_block: the tables are one sequence whose blocks are consecutive, starting there. Its
        keys and values are then one contiguous run per head in the heads-first pool, read in
        place with no copy at all (a sequence alone in the pool gets its blocks in order)."""
        k_scales, v_scales = self.scales(layer)
        if first_block is not None:
            blocks = slice(first_block, first_block + tables.shape[1])
            keys, values = self.k[layer][:, blocks].flatten(1, 2)[None], self.v[layer][:, blocks].flatten(1, 2)[None]
            if self.int8:
                k_scales, v_scales = (s[blocks].flatten(0, 1).T[None] for s in (k_scales, v_scales))
            return self._read(keys, k_scales), self._read(values, v_scales)
        k_pool, v_pool = self.layer(layer)
        _, block_size, kv_heads, head_dim = k_pool.shape
        shape = (kv_heads, tables.numel(), block_size, head_dim)
        numel = kv_heads * tables.numel() * block_size * head_dim
        if self._workspace.numel() < 2 * numel:  # grows to the largest step seen, then stays
            self._workspace = torch.empty(2 * numel, dtype=self.k.dtype, device=self.k.device)
        keys = gather_blocks(k_pool, tables, out=self._workspace[:numel].view(shape))
        values = gather_blocks(v_pool, tables, out=self._workspace[numel:2 * numel].view(shape))
        if self.int8:
            k_scales, v_scales = gather_blocks(k_scales, tables), gather_blocks(v_scales, tables)
        return self._read(keys, k_scales), self._read(values, v_scales)


@dataclass(slots=True)
class SequenceSlice:
    """One scheduled sequence's part of the packed step."""

    query_start: int  # where its new tokens start in the packed row
    query_len: int  # how many new tokens it brings
    context_len: int  # tokens it sees after this step (cached + new)
    block_table: list[int]


@dataclass
class DecodeGroup:
    """Decoding sequences of similar context length, attended in one call."""

    start: int  # their queries' rows in the packed step: [start, end)
    end: int
    tables: torch.Tensor  # int32 [seqs, widest table in the group]
    mask: Optional[torch.Tensor]  # bool [seqs, 1, 1, width * block_size]: True where a key is within the sequence
    first_block: Optional[int]  # one sequence whose blocks are consecutive from here (see KVPool.gather)


class PagedStep:
    def __init__(self, pool: KVPool, slices: list[SequenceSlice], positions: torch.Tensor,
                 use_kernels: bool = False, bucket_widths: bool = False, tables: Optional[torch.Tensor] = None) -> None:
        """slices: the scheduled sequences, prefills first, then decodes (one query each, by
        increasing context length on the gather path); positions: the packed tokens' positions (a
        CPU tensor), from which each token's KV slot follows. bucket_widths: on the gather path, pad
        a group of decodes to a bucket of blocks (`minfer.engine.buckets`), so that the attention
        matmuls meet few shapes too. tables: the slices' block tables as one int32 CPU tensor
        [seqs, at least the longest table] when the caller keeps them (`minfer.engine.block_tables`);
        else they are built from the slices' lists."""
        self.pool, self.slices, self.use_kernels = pool, slices, use_kernels
        self.num_tokens = len(positions)  # the packed row may be longer: bucket padding (minfer.engine.buckets)
        self.prefills = [s for s in slices if s.query_len > 1]
        self.decodes = [s for s in slices if s.query_len == 1]
        self.decode_start = self.decodes[0].query_start if self.decodes else len(positions)
        device = pool.k.device
        tables = block_tables(slices) if tables is None else tables
        # each token's sequence's table, int32 on the CPU (a decode-only step has one token per sequence already):
        # where its KV goes, and what a CUDA graph's step reads (`minfer.engine.cuda_graphs`)
        self.token_tables = (tables.repeat_interleave(torch.tensor([s.query_len for s in slices]), dim=0)
                             if self.prefills else tables)
        self.slot_mapping = to_device(slots_for_positions(self.token_tables, positions, pool.block_size), device)
        if use_kernels:  # one kernel call for all prefills, one for all decodes
            split = len(self.prefills)
            if self.prefills:
                self.prefill_tables = to_device(tables[:split], device)
                self.prefill_lens = to_device([s.context_len for s in self.prefills], device, torch.int32)
                starts = [s.query_start for s in self.prefills] + [self.decode_start]
                self.prefill_cu_seqlens = to_device(starts, device, torch.int32)
                self.prefill_max_q_len = max(s.query_len for s in self.prefills)  # known here: no sync per layer
            if self.decodes:
                self.decode_tables = to_device(tables[split:], device)
                self.decode_lens = to_device([s.context_len for s in self.decodes], device, torch.int32)
        else:  # the gather path: tables built once per step, not once per layer
            self.prefill_tables = [to_device(tables[i:i + 1, :len(s.block_table)], device) for i, s in enumerate(self.prefills)]
            self.prefill_runs = [first_of_run(s.block_table) for s in self.prefills]
            self.decode_groups, first = [], len(self.prefills)
            for group in split_by_length(self.decodes):
                self.decode_groups.append(decode_group(group, tables[first:first + len(group)], pool.block_size,
                                                         device, bucket_widths))
                first += len(group)

    def advance(self, num_tokens: int) -> None:
        """Nothing to do: positions and lengths come from the scheduler for every step."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: None = None) -> torch.Tensor:
        """q [1, heads, tokens, dim], k/v [1, kv_heads, tokens, dim] of the packed new tokens -> attention output.

        (No mask: who sees what follows from each sequence's slice.) Rows past the step's tokens
        are bucket padding: they store nothing, attend to nothing and come out as zeros."""
        if q.shape[2] > self.num_tokens:
            out = torch.zeros_like(q)
            real = slice(0, self.num_tokens)
            out[:, :, real] = self.attend(layer, q[:, :, real], k[:, :, real], v[:, :, real], attention_fn)
            return out
        if self.use_kernels:
            return self._attend_with_kernels(layer, q, k, v)
        self.pool.store(layer, k[0].transpose(0, 1), v[0].transpose(0, 1), self.slot_mapping)
        out = torch.empty_like(q)
        for s, table, first_block in zip(self.prefills, self.prefill_tables, self.prefill_runs):
            keys, values = self.pool.gather(layer, table, first_block)
            rows = slice(s.query_start, s.query_start + s.query_len)
            out[:, :, rows] = attention_fn(q[:, :, rows], keys[:, :, :s.context_len], values[:, :, :s.context_len], None)
        for group in self.decode_groups:
            keys, values = self.pool.gather(layer, group.tables, group.first_block)
            query = q[0, :, group.start:group.end].transpose(0, 1).unsqueeze(2)  # [seqs, heads, 1, dim]
            out[0, :, group.start:group.end] = attention_fn(query, keys, values, group.mask).squeeze(2).transpose(0, 1)
        return out

    def _attend_with_kernels(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        prefill = ((self.prefill_tables, self.prefill_cu_seqlens, self.prefill_lens, self.prefill_max_q_len)
                   if self.prefills else None)
        decode = (self.decode_tables, self.decode_lens) if self.decodes else None
        return attend_with_kernels(self.pool, layer, q, k, v, self.slot_mapping, self.decode_start, prefill, decode)


def attend_with_kernels(pool: KVPool, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slot_mapping: torch.Tensor, decode_start: int, prefill: Optional[tuple] = None,
                        decode: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """The Triton path (CUDA): write the new K/V into their slots, then read K/V straight from the
    pool through the block tables, without gathering copies.

    q [1, heads, tokens, dim], k/v [1, kv_heads, tokens, dim]: prefill tokens before decode_start,
    one decode token per sequence from there. prefill: (tables, cu_seqlens, context lens, longest
    chunk); decode: (tables, context lens). Nothing here reads a value back to the host, so a CUDA
    graph can record it (`minfer.engine.cuda_graphs`)."""
    from minfer.kernels.paged_cache import write_kv
    from minfer.kernels.paged_decode_attention import paged_decode_attention
    from minfer.kernels.paged_prefill_attention import paged_prefill_attention

    k_pool, v_pool = pool.layer(layer)
    k_scales, v_scales = pool.scales(layer)  # None unless the pools are int8 or fp8
    write_kv(k_pool, v_pool, k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous(), slot_mapping,
             k_scales, v_scales)
    tokens = q[0].transpose(0, 1).contiguous()  # [tokens, heads, dim]
    out = torch.empty_like(tokens)
    if prefill is not None:
        tables, cu_seqlens, lens, max_q_len = prefill
        out[:decode_start] = paged_prefill_attention(tokens[:decode_start], k_pool, v_pool, tables, cu_seqlens, lens,
                                                     k_scales=k_scales, v_scales=v_scales, max_q_len=max_q_len)
    if decode is not None:
        tables, lens = decode
        out[decode_start:] = paged_decode_attention(tokens[decode_start:], k_pool, v_pool, tables, lens,
                                                    k_scales=k_scales, v_scales=v_scales)
    return out.transpose(0, 1).unsqueeze(0)


def block_tables(slices: list[SequenceSlice]) -> torch.Tensor:
    """The slices' block tables as one int32 [seqs, longest] CPU tensor. Short rows are padded with
    block 0: a valid address that no reader uses, since every reader stops at its sequence's length."""
    width = widest_table(slices)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in slices], dtype=torch.int32)


def split_by_length(decodes: list[SequenceSlice], min_per_group: int = 8, max_groups: int = 4) -> list[list[SequenceSlice]]:
    """Cut decodes (sorted by context length) into up to max_groups groups of equal count, each
    of at least min_per_group sequences: padding to the longest in a group wastes less than
    padding to the longest of all, and a few more calls cost little. Neighbouring groups whose
    longest tables are equally long stay one group: splitting them would save no padding."""
    count = max(1, min(max_groups, len(decodes) // min_per_group))
    bounds = [round(i * len(decodes) / count) for i in range(count + 1)]
    groups: list[list[SequenceSlice]] = []
    for a, b in zip(bounds, bounds[1:]):
        if b > a and groups and widest_table(groups[-1]) == widest_table(decodes[a:b]):
            groups[-1] = groups[-1] + decodes[a:b]
        elif b > a:
            groups.append(decodes[a:b])
    return groups


def widest_table(slices: list[SequenceSlice]) -> int:
    return max(len(s.block_table) for s in slices)


def decode_group(decodes: list[SequenceSlice], tables: torch.Tensor, block_size: int, device: torch.device,
                  bucket_width: bool = False) -> DecodeGroup:
    """decodes: sequences of similar length; tables: their block tables, [len(decodes), at least the widest]."""
    tables = tables[:, :widest_table(decodes)]
    if bucket_width and len(decodes) > 1:  # (a lone sequence may be read in place: no padding there)
        tables = torch.nn.functional.pad(tables, (0, bucket_for(tables.shape[1]) - tables.shape[1]))  # block 0: masked
    tables = to_device(tables, device)
    width = tables.shape[1] * block_size
    lens = to_device([s.context_len for s in decodes], device)
    mask = (torch.arange(width, device=device)[None] < lens[:, None])[:, None, None, :]
    first_block = first_of_run(decodes[0].block_table) if len(decodes) == 1 else None
    return DecodeGroup(decodes[0].query_start, decodes[-1].query_start + 1, tables, mask, first_block)


def first_of_run(block_table: list[int]) -> Optional[int]:
    """The first block if the table is consecutive blocks (b, b + 1, ...), else None."""
    first = block_table[0]
    return first if block_table == list(range(first, first + len(block_table))) else None
