"""Decode steps replayed as CUDA graphs (the default on CUDA: `LLM(...)` with `enforce_eager=None` or False).

Why: a decode step of a small model is a few hundred small kernels (SmolLM2-135M: about 15 per
layer, 30 layers). At batch 1 the GPU finishes each of them in a few microseconds, about what
Python and PyTorch take to launch the next one, so the step runs at the speed of the launches,
not of the memory. A CUDA graph records the step's kernels once, with all their arguments, and
replays the whole sequence with one call: the per-kernel cost on the CPU disappears.

What a recording fixes: every kernel's arguments, pointers included, and so every shape. Hence:

* **Fixed buffers.** The step's inputs (token ids, positions, KV slots, block tables, context
  lengths) live in tensors allocated once; each replay first copies the step's values into them,
  and the recorded kernels read them there. The output (logits) is a fixed tensor too.
* **One graph per batch size**, the sizes of `minfer.engine.buckets` up to `max_num_seqs`. A step
  of n sequences replays the graph of the smallest bucket that holds n; the extra rows store
  nothing (slot -1) and attend to one token, and nobody reads their logits.
* **Nothing may wait for the GPU inside the step** (no `.item()`, no tensor built from Python
  numbers): the dense model with the Triton paged kernels qualifies (`attend_with_kernels`);
  mixture-of-experts layers, whose token counts per expert decide shapes, do not, and are served by
  the compiled step instead (`compiled_decode.py`).

Graphs are recorded lazily: the first decode step of each batch size runs the step once (Triton
compiles its kernels there; compiling cannot be recorded), records it and replays it. All graphs
share one memory pool, so together they hold about what the largest one needs.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from minfer.engine.buckets import TOKEN_BUCKETS, bucket_for
from minfer.engine.paged_kv import KVPool, attend_with_kernels
from minfer.layers.attention import AttentionFn
from minfer.models.llama import LlamaModel

# record(run, memory_pool) -> (replay, output, memory_pool): run() computes the step's logits.
Recorder = Callable[[Callable[[], torch.Tensor], Optional[tuple]], tuple[Callable[[], None], torch.Tensor, Optional[tuple]]]


def record_cuda_graph(run: Callable[[], torch.Tensor], memory_pool: Optional[tuple]):
    """Record run()'s kernels as a CUDA graph in the shared memory pool; its output tensor is rewritten by each replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory_pool):
        output = run()
    return graph.replay, output, graph.pool()


class GraphStep:
    """The KV cache a recorded step sees: the pool, read and written through the fixed buffers."""

    def __init__(self, pool: KVPool, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> None:
        self.pool, self.slot_mapping, self.block_tables, self.context_lens = pool, slot_mapping, block_tables, context_lens

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: None = None) -> torch.Tensor:
        return attend_with_kernels(self.pool, layer, q, k, v, self.slot_mapping, 0,
                                   decode=(self.block_tables, self.context_lens))

    def advance(self, num_tokens: int) -> None:
        """Nothing to do: the buffers hold every step's positions and lengths."""


class DecodeGraphs:
    def __init__(self, model: LlamaModel, pool: KVPool, max_num_seqs: int, max_blocks_per_seq: int,
                 record: Recorder = record_cuda_graph) -> None:
        self.model, self.pool, self.record = model, pool, record
        self.batch_sizes = sorted({b for b in TOKEN_BUCKETS if b < max_num_seqs} | {bucket_for(max_num_seqs)})
        largest, device = self.batch_sizes[-1], pool.k.device
        self.input_ids = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.replays: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # batch size -> (replay, logits)
        self.memory_pool: Optional[tuple] = None
        self.failed: Optional[str] = None  # why recording failed: every step then runs eagerly

    @staticmethod
    def supports(model: LlamaModel) -> bool:
        """A dense model: an MoE layer's shapes depend on its routing, which a recording cannot follow."""
        return not model.config.sparse_layers

    def serves(self, step) -> bool:
        """Whether this prepared step can be replayed: plain decodes on the kernel path that fit the buffers."""
        paged = step.paged
        return (self.failed is None and step.plain_decode and paged.use_kernels and bool(paged.decodes)
                and paged.num_tokens <= self.batch_sizes[-1] and paged.decode_tables.shape[1] <= self.block_tables.shape[1])

    def __call__(self, step) -> Optional[torch.Tensor]:
        """Logits [len(step.logits_indices), vocab] of a decode step, as the eager model gives them; None if
        the step's graph could not be recorded (the caller then runs the step eagerly)."""
        paged = step.paged
        num_seqs = paged.num_tokens
        size = bucket_for(num_seqs)  # one of batch_sizes: serves() kept num_seqs within the largest
        self.input_ids[:, :num_seqs] = step.input_ids[:, :num_seqs]
        self.positions[:, :num_seqs] = step.positions[:, :num_seqs]
        self.slot_mapping[:num_seqs] = paged.slot_mapping
        self.slot_mapping[num_seqs:size] = -1  # extra rows store nothing...
        self.block_tables[:num_seqs, :paged.decode_tables.shape[1]] = paged.decode_tables
        self.context_lens[:num_seqs] = paged.decode_lens
        self.context_lens[num_seqs:size] = 1  # ...and read one token of whatever block their row names
        if size not in self.replays and not self._record(size):
            return None
        replay, logits = self.replays[size]
        replay()
        return logits[0, step.logits_indices]

    def _record(self, size: int) -> bool:
        step = GraphStep(self.pool, self.slot_mapping[:size], self.block_tables[:size], self.context_lens[:size])

        def run() -> torch.Tensor:
            return self.model(self.input_ids[:, :size], self.positions[:, :size], step, last_only=False)

        try:
            run()  # once outside the recording: Triton compiles its kernels, PyTorch sets up its workspaces
            replay, logits, self.memory_pool = self.record(run, self.memory_pool)
        except RuntimeError as error:  # e.g. an operation that waits for the GPU, or out of memory
            self.failed = f"recording the decode step of {size} sequences failed: {error}"
            warnings.warn(f"{self.failed}; decode steps run eagerly from now on", RuntimeWarning, stacklevel=3)
            return False
        self.replays[size] = (replay, logits)
        return True
