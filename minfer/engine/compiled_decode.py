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
* **Token counts come in buckets.** Every new shape means a new compilation, so a decode batch of
  n sequences is padded to the next size in `BUCKETS`; the padding rows compute garbage that
  nothing reads, and attention never sees them (it is given the real rows only).

Only steps in which every sequence decodes one plain token are compiled; prompt chunks,
speculative verification and prompt scoring run eagerly. Whether compiling pays depends on the
device and on how long the process lives (compiling the buckets takes tens of seconds on a CPU;
`docs/benchmarks.md` has the measurements behind the defaults in `ModelRunner`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from minfer.layers.attention import AttentionFn
from minfer.models.llama import LlamaModel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

_active: dict = {}  # during one forward pass: the step, its real token count, the model's attention function


@contextlib.contextmanager
def active(step, num_tokens: int, attention_fn: AttentionFn) -> Iterator[None]:
    _active.update(step=step, num_tokens=num_tokens, attention_fn=attention_fn)
    try:
        yield
    finally:
        _active.clear()


@torch.library.custom_op("minfer::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The active step's attention for its real rows (the rest are bucket padding: zeros)."""
    out = torch.zeros_like(q)
    rows = slice(0, _active["num_tokens"])
    out[:, :, rows] = _active["step"].attend(layer, q[:, :, rows], k[:, :, rows], v[:, :, rows], _active["attention_fn"])
    return out


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


class _OpaqueCache:
    """What the compiled model sees as its KV cache: every layer's attention goes to the custom op."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn: AttentionFn,
               mask: None = None) -> torch.Tensor:
        return paged_attention(q, k, v, layer)

    def advance(self, num_tokens: int) -> None:
        """Nothing to do: the paged step knows its positions."""


def bucket_for(num_tokens: int) -> Optional[int]:
    """The smallest bucket that holds num_tokens, or None if it is larger than all of them."""
    return next((b for b in BUCKETS if b >= num_tokens), None)


class CompiledDecode:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.cache = _OpaqueCache()
        options = {"freezing": True} if model.embed_tokens.weight.device.type == "cpu" else {}
        self.forward = torch.compile(self._forward, dynamic=False, options=options)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self.cache, last_only=False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [1, len(logits_indices), vocab] of a decode step, as the eager model gives them."""
        num_tokens = input_ids.shape[1]
        pad = bucket_for(num_tokens) - num_tokens
        with active(step, num_tokens, self.model.attention_fn), torch.inference_mode():  # freezing needs it
            logits = self.forward(torch.nn.functional.pad(input_ids, (0, pad)), torch.nn.functional.pad(positions, (0, pad)))
        return logits[:, logits_indices]
