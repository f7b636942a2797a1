"""Tensor parallelism's two splits of a linear layer (Megatron-LM's), and the checkpoint slicing they need.

A decoder layer holds two pairs of matmuls: qkv_proj then o_proj, gate_up_proj then down_proj.
Each pair is split across N devices the same way:

* the first matmul is **column-parallel**: each device keeps a slice of the output features
  (whole attention heads, or a slice of the MLP's intermediate neurons: `split_rows`). Its output
  is a slice of the activations, which is all the next op needs (attention runs head by head,
  SwiGLU element by element), so nothing is communicated;
* the second is **row-parallel**: each device keeps the matching slice of the input features
  (`split_columns`) and computes a partial sum of the full output. One all-reduce (a sum over
  devices) turns the partial sums into the layer's output on every device (`RowParallelLinear`).

So a layer costs two all-reduces of [tokens, hidden_size], whatever N. Everything else (norms,
embedding, output head) is replicated: see `minfer.engine.parallel` for why the embedding and the
head are not split by vocabulary.

Grouped-query attention: query head i reads KV head i // (num_heads / num_kv_heads). Splitting
the q heads and the KV heads into N contiguous groups keeps each query head on the device of
its KV head, so N must divide both head counts (`shard_model_config` says so otherwise).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from minfer.config import ModelConfig

# checkpoint matrices (Hugging Face names) by how they are split
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features: rows of the weight
ROW_PARALLEL = ("o_proj", "down_proj")  # input features: columns of the weight


def split_rows(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Column-parallel shard: rank's contiguous 1/world_size of the output features (weight rows; a bias too)."""
    rows = weight.shape[0] // world_size
    return weight[rank * rows:(rank + 1) * rows].contiguous()


def split_columns(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Row-parallel shard: rank's contiguous 1/world_size of the input features (weight columns)."""
    cols = weight.shape[1] // world_size
    return weight[:, rank * cols:(rank + 1) * cols].contiguous()


def shard_model_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shape one device's shard has: 1/world_size of the heads and intermediate neurons."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    if any("expert" in f.name and getattr(config, f.name) for f in dataclasses.fields(config)) and world_size > 1:
        raise ValueError("tensor_parallel_size > 1 does not support mixture-of-experts models yet")
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
             "intermediate_size": config.intermediate_size}
    wrong = {name: size for name, size in sizes.items() if size % world_size}
    if wrong:
        allowed = [n for n in range(1, config.num_kv_heads + 1) if all(s % n == 0 for s in sizes.values())]
        raise ValueError(f"tensor_parallel_size={world_size} must divide the model's {', '.join(wrong)} "
                         f"({', '.join(map(str, wrong.values()))}): every device takes whole query heads together "
                         f"with their KV heads; for this model it may be one of {allowed}")
    return dataclasses.replace(config, num_heads=config.num_heads // world_size,
                               num_kv_heads=config.num_kv_heads // world_size,
                               intermediate_size=config.intermediate_size // world_size)


def shard_weights(weights: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """rank's part of a Hugging Face-named checkpoint: split matrices sliced, everything else shared as is."""
    shard = {}
    for name, tensor in weights.items():
        kind = name.split(".")[-2] if name.count(".") >= 2 else ""
        if kind in COLUMN_PARALLEL:
            shard[name] = split_rows(tensor, rank, world_size)  # q/k/v rows are whole heads, in order
        elif kind in ROW_PARALLEL and tensor.dim() == 1:  # a bias is added once, after the sum: on rank 0
            shard[name] = tensor if rank == 0 else torch.zeros_like(tensor)
        elif kind in ROW_PARALLEL:
            shard[name] = split_columns(tensor, rank, world_size)
        else:
            shard[name] = tensor
    return shard


@dataclass
class CommStats:
    """Collectives as one rank saw them. Time includes waiting for the slowest rank to arrive."""

    all_reduces: int = 0
    all_reduce_bytes: int = 0  # the tensors' sizes (each rank sends and receives about this much again)
    all_reduce_seconds: float = 0.0
    broadcasts: int = 0  # rank 0's step messages to the workers
    broadcast_bytes: int = 0
    broadcast_seconds: float = 0.0


class RowParallelLinear(nn.Module):
    """A row-parallel shard of a linear (any layer with forward(x): float, int8, int4), then the all-reduce."""

    def __init__(self, linear: nn.Module, stats: CommStats, group=None) -> None:
        super().__init__()
        self.linear, self.stats, self.group = linear, stats, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear(x)  # this device's inputs' share of every output feature
        start = time.perf_counter()
        dist.all_reduce(partial, group=self.group)  # in place: the sum over devices
        self.stats.all_reduce_seconds += time.perf_counter() - start
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += partial.numel() * partial.element_size()
        return partial


def wrap_row_parallel(model: nn.Module, stats: CommStats, group=None) -> None:
    """Put an all-reduce behind every layer's o_proj and down_proj, in place (after quantizing and packing)."""
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, stats, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, stats, group)
