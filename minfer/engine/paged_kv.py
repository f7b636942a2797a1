"""The paged KV cache as the model sees it during one engine step.

`KVPool` holds the memory: per layer a K pool and a V pool of shape
[num_blocks, block_size, num_kv_heads, head_dim]. Token t of a sequence lives in block
`block_table[t // block_size]` at offset `t % block_size`; its flat *slot* is
block * block_size + offset.

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

import torch

from minfer.config import ModelConfig
from minfer.layers.attention import AttentionFn


class KVPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class SequenceSlice:
    """One scheduled sequence's part of the packed step."""

    query_start: int  # where its new tokens start in the packed row
    query_len: int  # how many new tokens it brings
    context_len: int  # tokens it sees after this step (cached + new)
    block_table: list[int]


class PagedStep:
    def __init__(self, pool: KVPool, slices: list[SequenceSlice], slot_mapping: torch.Tensor,
                 use_kernels: bool = False) -> None:
        self.pool, self.slices, self.slot_mapping, self.use_kernels = pool, slices, slot_mapping, use_kernels
        self.prefills = [s for s in slices if s.query_len > 1]
        self.decodes = [s for s in slices if s.query_len == 1]
        self.decode_start = self.decodes[0].query_start if self.decodes else len(slot_mapping)
        device = slot_mapping.device
        if self.decodes:  # decodes are packed after the prefills: one gather (or one kernel) serves them all
            self.decode_tables = block_tables(self.decodes, device)
            self.decode_lens = torch.tensor([s.context_len for s in self.decodes], dtype=torch.int32, device=device)
            positions = torch.arange(self.decode_tables.shape[1] * pool.block_size, device=device)
            self.decode_mask = (positions[None] < self.decode_lens[:, None])[:, None, None, :]  # [seqs, 1, 1, kv]
        # built once per step, not once per layer
        self.prefill_rows = [torch.tensor([s.block_table], device=device) for s in self.prefills]
        if self.prefills and use_kernels:
            self.prefill_tables = block_tables(self.prefills, device)
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
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        flat = (-1, k.shape[1], k.shape[3])
        k_pool.view(flat)[self.slot_mapping] = k[0].transpose(0, 1)
        v_pool.view(flat)[self.slot_mapping] = v[0].transpose(0, 1)
        out = torch.empty_like(q)
        for s, table in zip(self.prefills, self.prefill_rows):
            keys = gather(k_pool, table)[:, :, :s.context_len]
            values = gather(v_pool, table)[:, :, :s.context_len]
            query = q[:, :, s.query_start:s.query_start + s.query_len]
            out[:, :, s.query_start:s.query_start + s.query_len] = attention_fn(query, keys, values, None)
        if self.decodes:
            keys, values = gather(k_pool, self.decode_tables), gather(v_pool, self.decode_tables)
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
        write_kv(k_pool, v_pool, k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous(), self.slot_mapping)
        tokens = q[0].transpose(0, 1).contiguous()  # [tokens, heads, dim]
        out = torch.empty_like(tokens)
        split = self.decode_start
        if self.prefills:
            out[:split] = paged_prefill_attention(tokens[:split], k_pool, v_pool, self.prefill_tables,
                                                  self.prefill_cu_seqlens, self.prefill_lens)
        if self.decodes:
            out[split:] = paged_decode_attention(tokens[split:], k_pool, v_pool, self.decode_tables, self.decode_lens)
        return out.transpose(0, 1).unsqueeze(0)


def block_tables(slices: list[SequenceSlice], device: torch.device) -> torch.Tensor:
    """The slices' block tables as one int32 [seqs, longest] tensor (short rows padded with block 0, never read)."""
    width = max(len(s.block_table) for s in slices)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in slices],
                        dtype=torch.int32, device=device)


def gather(pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[seqs, blocks] block ids -> [seqs, kv_heads, blocks * block_size, head_dim] keys or values, copied out."""
    blocks = pool[tables.long()]  # [seqs, blocks, block_size, kv_heads, head_dim]
    seqs, nblocks, size, heads, dim = blocks.shape
    return blocks.reshape(seqs, nblocks * size, heads, dim).transpose(1, 2)
