"""Decode steps replayed as CUDA graphs (the default on CUDA: `LLM(...)` with `enforce_eager=None` or False).

Why: a decode step of a small model is a few hundred small kernels (SmolLM2-135M: about 15 per
layer, 30 layers). At batch 1 the GPU finishes each of them in a few microseconds, about what
Python and PyTorch take to launch the next one, so the step runs at the speed of the launches,
not of the memory. A CUDA graph records the step's kernels once, with all their arguments, and
replays the whole sequence with one call: the per-kernel cost on the CPU disappears.

What a recording fixes: every kernel's arguments, pointers included, and so every shape. Hence:

* **Fixed buffers.** The step's inputs (token ids, positions, KV slots, block tables, context
  lengths) live in tensors allocated once; each replay first copies the step's values into them,
  and the recorded kernels read them there. The outputs (logits, and the hidden states an EAGLE
  head reads) are fixed tensors too.
* **Every token is a decode row.** A row holds one new token, its sequence's block table and how
  many tokens it may see: its own position + 1. A plain decode step has one row per sequence; a
  speculative verification pass (the last token and k drafts) has 1 + k rows per sequence, all
  stored before any is attended to, so each row sees its sequence up to itself and no further,
  which is the causal mask. Graphs therefore serve every step whose sequences bring at most
  `max_query_len` tokens (1 + num_speculative_tokens): the target's side of speculative decoding
  replays too, not only plain decoding. The price: each row reads its sequence's K/V itself, so a
  verification pass reads a sequence's cache 1 + k times where the eager prefill kernel reads it
  once. At small batches, where speculation pays, the launches saved weigh far more.
* **One graph per row count**, the sizes of `minfer.engine.buckets` up to max_num_seqs x
  max_query_len. A step of n rows replays the graph of the smallest size that holds n; the extra
  rows store nothing (slot -1) and attend to one token, and nobody reads their outputs.
* **Nothing may wait for the GPU inside the step** (no `.item()`, no tensor built from Python
  numbers): the dense model with the Triton paged kernels qualifies (`attend_with_kernels`);
  mixture-of-experts layers, whose token counts per expert decide shapes, do not, and are served by
  the compiled step instead (`compiled_decode.py`).

Graphs are recorded lazily: the first step of each size runs once (Triton compiles its kernels
there; compiling cannot be recorded), is recorded and replayed. A step that must also return hidden
states (`PreparedStep.hidden_layers`) has graphs of its own. All graphs share one memory pool, so
together they hold about what the largest one needs, besides their outputs.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from minfer.engine.buckets import TOKEN_BUCKETS, bucket_for
from minfer.engine.paged_kv import KVPool, attend_with_kernels
from minfer.host_copy import to_device
from minfer.layers.attention import AttentionFn
from minfer.models.llama import LlamaModel

# record(run, memory_pool) -> (replay, outputs, memory_pool): run() computes the step's (logits, hidden states or None).
Recorder = Callable[[Callable[[], tuple], Optional[tuple]], tuple[Callable[[], None], tuple, Optional[tuple]]]


def record_cuda_graph(run: Callable[[], tuple], memory_pool: Optional[tuple]):
    """Record run()'s kernels as a CUDA graph in the shared memory pool; its output tensors are rewritten by each replay."""
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
                 record: Recorder = record_cuda_graph, max_query_len: int = 1) -> None:
        """max_query_len: the most new tokens a sequence brings to a served step (1 + its speculative drafts)."""
        self.model, self.pool, self.record, self.max_query_len = model, pool, record, max_query_len
        most = max_num_seqs * max_query_len
        self.sizes = sorted({b for b in TOKEN_BUCKETS if b < most} | {bucket_for(most)})  # rows per recording
        largest, device = self.sizes[-1], pool.k.device
        self.input_ids = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        # (rows, hidden layers or None) -> (replay, (logits [1, rows, vocab], hidden states [1, rows, width] or None))
        self.replays: dict[tuple[int, Optional[tuple[int, ...]]], tuple[Callable[[], None], tuple]] = {}
        self.memory_pool: Optional[tuple] = None
        self.failed: Optional[str] = None  # why recording failed: every step then runs eagerly

    @staticmethod
    def supports(model: LlamaModel) -> bool:
        """A dense model: an MoE layer's shapes depend on its routing, which a recording cannot follow."""
        return not model.config.sparse_layers

    def serves(self, step) -> bool:
        """Whether this prepared step can be replayed: on the kernel path, at most max_query_len tokens per
        sequence, and no more rows or blocks than the buffers hold."""
        paged = step.paged
        return (self.failed is None and paged.use_kernels and paged.num_tokens <= self.sizes[-1]
                and all(s.query_len <= self.max_query_len for s in paged.slices)
                and paged.token_tables.shape[1] <= self.block_tables.shape[1])

    def __call__(self, step) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(logits [len(step.logits_indices), vocab], and with step.hidden_layers the hidden states [tokens, width])
        as the eager model gives them; None if the step's graph could not be recorded (the caller then runs
        the step eagerly)."""
        paged = step.paged
        rows = paged.num_tokens
        size = bucket_for(rows)  # one of sizes: serves() kept the rows within the largest
        tables = paged.token_tables
        self._copy_inputs(step, rows)
        self.input_ids[:, :rows] = step.input_ids[:, :rows]
        self.positions[:, :rows] = step.positions[:, :rows]
        self.slot_mapping[:rows] = paged.slot_mapping
        self.slot_mapping[rows:size] = -1  # extra rows store nothing...
        self.block_tables[:rows, :tables.shape[1]] = to_device(tables, self.block_tables.device)
        self.context_lens[:rows] = step.positions[0, :rows] + 1  # each row sees its sequence up to itself
        self.context_lens[rows:size] = 1  # ...and read one token of whatever block their row names
        key = (size, step.hidden_layers)
        if key not in self.replays and not self._record(*key):
            return None
        replay, (logits, hidden) = self.replays[key]
        replay()
        # copies: the next replay rewrites the outputs
        return logits[0, step.logits_indices], None if hidden is None else hidden[0, :rows].clone()

    def _copy_inputs(self, step, rows: int) -> None:
        """Inputs beyond the model's usual ones, into buffers of their own (none here; an EAGLE head's features)."""

    def _forward(self, size: int, step: GraphStep, hidden_layers: Optional[tuple[int, ...]]) -> tuple:
        """The recorded computation over the buffers' first `size` rows: (logits, hidden states or None)."""
        input_ids, positions, model = self.input_ids[:, :size], self.positions[:, :size], self.model
        if hidden_layers is None:
            return model(input_ids, positions, step, last_only=False), None
        hidden = model.hidden_states(input_ids, positions, step, keep_layers=hidden_layers)
        return model.logits(hidden[..., -model.config.hidden_size:]), hidden

    def _record(self, size: int, hidden_layers: Optional[tuple[int, ...]]) -> bool:
        step = GraphStep(self.pool, self.slot_mapping[:size], self.block_tables[:size], self.context_lens[:size])

        @torch.inference_mode()
        def run() -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            return self._forward(size, step, hidden_layers)

        try:
            run()  # once outside the recording: Triton compiles its kernels, PyTorch sets up its workspaces
            replay, outputs, self.memory_pool = self.record(run, self.memory_pool)
        except RuntimeError as error:  # e.g. an operation that waits for the GPU, or out of memory
            self.failed = f"recording the decode step of {size} rows failed: {error}"
            warnings.warn(f"{self.failed}; decode steps run eagerly from now on", RuntimeWarning, stacklevel=3)
            return False
        self.replays[size, hidden_layers] = (replay, outputs)
        return True
