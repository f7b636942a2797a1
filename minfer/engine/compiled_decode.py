"""The decode step compiled with torch.compile (`LLM(..., enforce_eager=False)`).

A decode step of a small model is a few hundred small operations per token, and in eager
PyTorch each one pays Python and dispatch overhead. A compiler traces the step once into a graph,
fuses the element-wise work (norms, RoPE, residuals, SwiGLU) and, on CPU with "freezing", packs
the weights for oneDNN as part of the graph.

Two things keep the graph traceable and its shapes few:

* **Attention is one opaque operation.** The paged step (`PagedStep`) is plain Python that looks
  up block tables and calls kernels; the compiler should not look inside. `paged_attention` is a
  registered custom op that only says "q, k, v of this layer in, attention out"; the step it
  serves is the one `active(step)` installed for the duration of the forward pass (the way vLLM
  passes its attention metadata, through a forward context).
* **Token counts come in buckets.** Every new shape means a new compilation; the model runner
  already pads every step to a size of `minfer.engine.buckets` (the padding rows compute garbage
  that nothing reads, and attention skips them), so one graph per bucket serves every batch.

Only steps in which every sequence decodes one plain token are compiled; prompt chunks,
speculative verification, prompt scoring and steps that hand hidden states to an EAGLE head run
eagerly. Whether compiling pays depends on the device and on how long the process lives (compiling
the buckets takes tens of seconds on a CPU; `docs/benchmarks.md` has the measurements behind the
defaults in `ModelRunner`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from minfer.engine.buckets import TOKEN_BUCKETS
from minfer.layers.attention import AttentionFn
from minfer.models.llama import LlamaModel

MAX_COMPILED_TOKENS = 512  # larger decode steps run eagerly (a step of 512 sequences is beyond any default)

_active: dict = {}  # during one forward pass: the step and the model's attention function


@contextlib.contextmanager
def active(step, attention_fn: AttentionFn) -> Iterator[None]:
    _active.update(step=step, attention_fn=attention_fn)
    try:
        yield
    finally:
        _active.clear()


@torch.library.custom_op("minfer::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The active step's attention (its bucket-padding rows come out as zeros), contiguous: the compiled graph
    checks the strides its fake promised, and the kernels' output is laid out token by token, not as q."""
    return _active["step"].attend(layer, q, k, v, _active["attention_fn"]).contiguous()


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, as the real op returns it


class _OpaqueCache:
    """What the compiled model sees as its KV cache: every layer's attention goes to the custom op."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: None = None) -> torch.Tensor:
        return paged_attention(q, k, v, layer)

    def advance(self, num_tokens: int) -> None:
        """Nothing to do: the paged step knows its positions."""


class CompiledDecode:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.cache = _OpaqueCache()
        options = {"freezing": True} if model.embed_tokens.weight.device.type == "cpu" else {}
        # one graph per bucket size: Dynamo's default limit (8 recompiles) would leave the larger buckets eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(TOKEN_BUCKETS))
        self.forward = torch.compile(self._forward, dynamic=False, options=options)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.cache, last_only=False)

    @staticmethod
    def serves(step) -> bool:
        """Whether a prepared step is one the compiled model runs: plain decodes, padded to a bucket it compiles,
        that need no hidden states."""
        return step.plain_decode and step.hidden_layers is None and step.input_ids.shape[1] <= MAX_COMPILED_TOKENS

    def __call__(self, step) -> tuple[torch.Tensor, None]:
        """(logits [len(step.logits_indices), vocab] of a decode step (padded to a bucket), as the eager model gives
        them, no hidden states)."""
        with active(step.paged, self.model.attention_fn), torch.inference_mode():  # freezing needs it
            logits = self.forward(step.input_ids, step.positions)
        return logits[0, step.logits_indices], None
