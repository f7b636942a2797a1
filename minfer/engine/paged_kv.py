"""The paged KV cache as the model sees it during one engine step.

`KVPool` holds the memory: per layer a K pool and a V pool of shape
[num_blocks, block_size, num_kv_heads, head_dim]. Token t of a sequence lives in block
`block_table[t // block_size]` at offset `t % block_size`; its flat *slot* is
block * block_size + offset. The pools hold the model's dtype (kv_cache_dtype "auto") or int8
("int8"): then a float32 scale per (token, KV head) sits beside them, [num_blocks, block_size,
num_kv_heads] per layer, tokens are quantized as they are stored and dequantized as they are read
(`minfer/formats/kv.py`), and the same memory holds about twice as many tokens as bfloat16.

`PagedStep` describes one step's batch: the new tokens of every scheduled sequence packed
into one row (prefill chunks first, then one token per decoding sequence), where each
sequence's tokens go (slot mapping), and what each sequence may look at (its block table and
context length). The model hands every layer's q, k, v to `PagedStep.attend`, which stores the
new k, v in their slots and runs attention over each sequence's whole context.

On CPU, attention gathers each sequence's K/V out of the pool into a contiguous tensor and calls
the model's attention function (the same contract as the contiguous cache: mask None means causal
with the queries last). Decoding sequences are gathered together and served in one call. On CUDA
the Triton kernels of `minfer.kernels` read the pool through the block tables instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minfer.config import KV_CACHE_DTYPES, ModelConfig
from minfer.formats.kv import dequantize_kv, quantize_kv
from minfer.kernels.paged_cache import slots_for_positions
from minfer.layers.attention import AttentionFn


class KVPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, kv_cache_dtype: str = "auto") -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.quantized = kv_cache_dtype == "int8"
        self.dtype = dtype  # the model's: what reads return
        self.k = torch.zeros(shape, dtype=torch.int8 if self.quantized else dtype, device=device)
        self.v = torch.zeros_like(self.k)
        # int8 only: one float32 scale per (layer, block, offset, KV head)
        self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if self.quantized else None
        self.v_scale = torch.zeros_like(self.k_scale) if self.quantized else None
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        scales = self.k_scale.nbytes + self.v_scale.nbytes if self.quantized else 0
        return self.k.nbytes + self.v.nbytes + scales

    def scales(self, layer: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The layer's K and V scale pools (None, None unless int8)."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write k, v [tokens, kv_heads, head_dim] at their slots (quantizing them for an int8 pool)."""
        if not self.quantized:
            self.k[layer].view(-1, *k.shape[1:])[slots] = k
            self.v[layer].view(-1, *v.shape[1:])[slots] = v
            return
        for pool, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values, scale = quantize_kv(new)  # int8 [tokens, kv_heads, head_dim], float32 [tokens, kv_heads]
            pool[layer].view(-1, *new.shape[1:])[slots] = values
            scales[layer].view(-1, new.shape[1])[slots] = scale

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks, [seqs, kv_heads, blocks * block_size, head_dim], in the model's dtype."""
        keys, values = gather(self.k[layer], tables), gather(self.v[layer], tables)
        if self.quantized:
            keys = dequantize_kv(keys, gather(self.k_scale[layer], tables), self.dtype)
            values = dequantize_kv(values, gather(self.v_scale[layer], tables), self.dtype)
        return keys, values


@dataclass
class SequenceSlice:
    """One scheduled sequence's part of the packed step."""

    query_start: int  # where its new tokens start in the packed row
    query_len: int  # how many new tokens it brings
    context_len: int  # tokens it sees after this step (cached + new)
    block_table: list[int]


class PagedStep:
    def __init__(self, pool: KVPool, slices: list[SequenceSlice], positions: torch.Tensor,
                 use_kernels: bool = False) -> None:
        """slices: the scheduled sequences, prefills first, then decodes (one query each); positions:
        the packed tokens' positions (a CPU tensor), from which each token's KV slot follows."""
        self.pool, self.slices, self.use_kernels = pool, slices, use_kernels
        self.prefills = [s for s in slices if s.query_len > 1]
        self.decodes = [s for s in slices if s.query_len == 1]
        self.decode_start = self.decodes[0].query_start if self.decodes else len(positions)
        device = pool.k.device
        tables = block_tables(slices)
        token_rows = tables.repeat_interleave(torch.tensor([s.query_len for s in slices]), dim=0)
        self.slot_mapping = slots_for_positions(token_rows, positions, pool.block_size).to(device)
        if self.decodes:  # decodes are packed after the prefills: one gather (or one kernel) serves them all
            width = max(len(s.block_table) for s in self.decodes)
            self.decode_tables = tables[len(self.prefills):, :width].to(device)
            self.decode_lens = torch.tensor([s.context_len for s in self.decodes], dtype=torch.int32, device=device)
            if not use_kernels:  # the gather path pads every decode to the longest table: mask the padding
                kv_positions = torch.arange(width * pool.block_size, device=device)
                self.decode_mask = (kv_positions[None] < self.decode_lens[:, None])[:, None, None, :]  # [seqs, 1, 1, kv]
        if not use_kernels:  # the gather path's per-prefill block tables, built once per step, not once per layer
            self.prefill_rows = [tables[i:i + 1, :len(s.block_table)].to(device) for i, s in enumerate(self.prefills)]
        elif self.prefills:
            self.prefill_tables = tables[:len(self.prefills)].to(device)
            self.prefill_lens = torch.tensor([s.context_len for s in self.prefills], dtype=torch.int32, device=device)
            starts = [s.query_start for s in self.prefills] + [self.decode_start]
            self.prefill_cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)

    def advance(self, num_tokens: int) -> None:
        """Nothing to do: positions and lengths come from the scheduler for every step."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: None = None) -> torch.Tensor:
        """q [1, heads, tokens, dim], k/v [1, kv_heads, tokens, dim] of the packed new tokens -> attention output.

        (No mask: who sees what follows from each sequence's slice.)"""
        if self.use_kernels:
            return self._attend_with_kernels(layer, q, k, v)
        self.pool.store(layer, k[0].transpose(0, 1), v[0].transpose(0, 1), self.slot_mapping)
        out = torch.empty_like(q)
        for s, table in zip(self.prefills, self.prefill_rows):
            keys, values = self.pool.gather(layer, table)
            keys, values = keys[:, :, :s.context_len], values[:, :, :s.context_len]
            query = q[:, :, s.query_start:s.query_start + s.query_len]
            out[:, :, s.query_start:s.query_start + s.query_len] = attention_fn(query, keys, values, None)
        if self.decodes:
            keys, values = self.pool.gather(layer, self.decode_tables)
            query = q[0, :, self.decode_start:].transpose(0, 1).unsqueeze(2)  # [seqs, heads, 1, dim]
            result = attention_fn(query, keys, values, self.decode_mask)
            out[0, :, self.decode_start:] = result.squeeze(2).transpose(0, 1)
        return out

    def _attend_with_kernels(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The Triton path (CUDA): write the new K/V into their slots, then read K/V straight from
        the pool through the block tables, without gathering copies."""
        from minfer.kernels.paged_cache import write_kv
        from minfer.kernels.paged_decode_attention import paged_decode_attention
        from minfer.kernels.paged_prefill_attention import paged_prefill_attention

        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        k_scales, v_scales = self.pool.scales(layer)  # None unless the pools are int8
        write_kv(k_pool, v_pool, k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous(), self.slot_mapping,
                 k_scales, v_scales)
        tokens = q[0].transpose(0, 1).contiguous()  # [tokens, heads, dim]
        out = torch.empty_like(tokens)
        split = self.decode_start
        if self.prefills:
            out[:split] = paged_prefill_attention(tokens[:split], k_pool, v_pool, self.prefill_tables,
                                                  self.prefill_cu_seqlens, self.prefill_lens,
                                                  k_scales=k_scales, v_scales=v_scales)
        if self.decodes:
            out[split:] = paged_decode_attention(tokens[split:], k_pool, v_pool, self.decode_tables, self.decode_lens,
                                                 k_scales=k_scales, v_scales=v_scales)
        return out.transpose(0, 1).unsqueeze(0)


def block_tables(slices: list[SequenceSlice]) -> torch.Tensor:
    """The slices' block tables as one int32 [seqs, longest] CPU tensor. Short rows are padded with
    block 0: a valid address that no reader uses, since every reader stops at its sequence's length."""
    width = max(len(s.block_table) for s in slices)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in slices], dtype=torch.int32)


def gather(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[seqs, blocks] block ids -> [seqs, kv_heads, blocks * block_size, head_dim] keys or values, copied out
    (or [seqs, kv_heads, blocks * block_size] from a scale pool)."""
    blocks = pool[tables.long()]  # [seqs, blocks, block_size, kv_heads(, head_dim)]
    return blocks.flatten(1, 2).transpose(1, 2)
