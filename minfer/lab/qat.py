"""Quantization-aware fine-tuning (QAT): train the float weights so that their int4 rounding loses less.

    prepare_qat(model, trainable=("qkv_proj", "down_proj"))     # every matrix fake-quantized, two trained
    train_qat(model, teacher, batches, steps=300)                # distil the float model's logits
    finish_qat(model); quantize_model(model, "int4", 64)         # plain int4 of the tuned weights

Post-training quantization (round-to-nearest, AWQ, GPTQ) takes the trained weights as given and
picks the codes. QAT changes the weights themselves, with the rounding in the loop:

- *Fake quantization.* In the forward pass each matrix is replaced by what int4 g64 would store
  for it, quantize -> dequantize on minfer's own grid (``minfer.quant.awq.fake_quantize_int4``,
  i.e. ``quantize_int4_groupwise``): the network computes exactly what the int4 model will.
- *Straight-through gradients* (Bengio et al., 2013). Rounding has zero gradient almost
  everywhere, so the backward pass pretends it was the identity: ``w + (fq(w) - w).detach()``
  has the value ``fq(w)`` and the gradient of ``w``. The float weights drift until a *different*
  rounding of them serves the loss better; the float weights are a latent copy, never shipped.
- *Distillation.* The loss is KL(float model's next-token distribution || the fake-quantized
  model's) at every position of text kept apart from the evaluation text: the target is the
  float model's behaviour, not the text (training on the text itself would also adapt the model
  to pydoc's style, and perplexity on pydoc would fall for a reason that has nothing to do with
  quantization).

What is trained: the matrices rounding hurts most (``benchmarks/train_qat.py`` measures the
perplexity of quantizing one kind of matrix at a time); all four kinds are fake-quantized, the
others frozen at their rounded values, so the trained ones also make up for the others' errors.
After ``finish_qat`` the model holds plain float weights again, and ``quantize_model(model,
"int4", 64)`` rounds them on the grid they were trained against: the fine-tuned int4 model is an
ordinary int4 model, same bytes, same kernels, same checkpoint format.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minfer.lab.evaluate import context_windows
from minfer.layers.linear import bf16_autocast, linear_like
from minfer.models.llama import DecoderLayer
from minfer.quant.awq import fake_quantize_int4
from minfer.lab.distill import distillation_loss, final_hidden, run_training
from minfer.texts import EVAL_TOPICS, eval_text

QAT_GROUP_SIZE = 64
LINEAR_NAMES = tuple(name for _, name in DecoderLayer.LINEARS)
SHARED_LINE_CHARS = 60  # a training topic sharing a line this long with the evaluation text is left out


def default_checkpoint_dir() -> Path:
    """Where benchmarks/train_qat.py writes its int4 checkpoint, and where the benchmark and the chapter
    look for it: $MINFER_CACHE (default ~/.cache/minfer)/smollm2-135m-qat-int4-g64. Not shipped: about
    200 MB (the float32 embedding 113 MB, the int4 layers 60 MB, the int8 head 28 MB)."""
    cache = Path(os.environ.get("MINFER_CACHE", Path.home() / ".cache" / "minfer"))
    return cache / "smollm2-135m-qat-int4-g64"


def training_topics() -> list[str]:
    """The pydoc topics QAT trains on: all but the evaluation topics and those that repeat their text
    (e.g. "compound" contains "try", "with", "function" and "class"; "naming" is part of "execmodel")."""
    from pydoc_data.topics import topics

    eval_lines = {line.strip() for line in eval_text().splitlines() if len(line.strip()) > SHARED_LINE_CHARS}
    return [name for name in sorted(topics) if name not in EVAL_TOPICS
            and not any(line.strip() in eval_lines for line in topics[name].splitlines())]


def training_rows(tokenizer, seq_len: int, seed: int = 0) -> torch.Tensor:
    """The training text (`training_topics`) as token rows [rows, seq_len], in a shuffled order."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[name].strip() for name in training_topics()), add_special_tokens=False)
    rows = torch.tensor(ids[: len(ids) // seq_len * seq_len]).view(-1, seq_len)
    return rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))]


def straight_through(w: torch.Tensor, group_size: int = QAT_GROUP_SIZE) -> torch.Tensor:
    """int4 round-to-nearest of w in the forward pass, the identity in the backward pass."""
    return w + (fake_quantize_int4(w.detach(), group_size).to(w.dtype) - w).detach()


class FakeQuantLinear(nn.Module):
    """A linear layer whose float weight is trained but always used as its int4 rounding."""

    def __init__(self, linear: nn.Linear, group_size: int = QAT_GROUP_SIZE) -> None:
        super().__init__()
        self.weight, self.bias, self.group_size = linear.weight, linear.bias, group_size
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, straight_through(self.weight, self.group_size), self.bias)


def _linears(model: nn.Module):
    for i, layer in enumerate(model.layers):
        for block_name, name in layer.LINEARS:
            yield i, getattr(layer, block_name), name


def prepare_qat(model: nn.Module, trainable: Sequence[str] = ("qkv_proj", "down_proj"),
                group_size: int = QAT_GROUP_SIZE) -> list[nn.Parameter]:
    """Fake-quantize the four matrices of every layer in place; returns the parameters to train.

    Matrices named in `trainable` become FakeQuantLinear; the others are rounded once, frozen (they
    would round the same way every step) and made plain nn.Linear (so gradients pass through them).
    Everything else (embedding, norms, head) is frozen.
    """
    unknown = [name for name in trainable if name not in LINEAR_NAMES]
    if unknown or not trainable:
        raise ValueError(f"trainable must name some of {LINEAR_NAMES}, got {list(trainable)}")
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    with torch.no_grad():
        for _, block, name in _linears(model):
            linear = getattr(block, name)
            if name in trainable:
                linear.weight.requires_grad_(True)
                params.append(linear.weight)
                setattr(block, name, FakeQuantLinear(linear, group_size))
            else:
                linear.weight.copy_(fake_quantize_int4(linear.weight, group_size))
                setattr(block, name, linear_like(linear))  # a PackedLinear (oneDNN) has no backward
    return params


def finish_qat(model: nn.Module) -> nn.Module:
    """Put plain nn.Linear layers back (holding the tuned float weights), ready for quantize_model."""
    for _, block, name in _linears(model):
        layer = getattr(block, name)
        if isinstance(layer, FakeQuantLinear):
            layer.weight.requires_grad_(False)
            setattr(block, name, linear_like(layer))
    return model.eval()


def logits_of(model: nn.Module, input_ids: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """Next-token logits [batch, seq, vocab] at every position, with autograd (bf16: autocast matmuls where that
    is faster, `bf16_autocast`)."""
    input_ids = input_ids.to(model.embed_tokens.weight.device)  # training rows are made on the CPU
    with bf16_autocast(input_ids.device.type, bf16):
        hidden = final_hidden(model, input_ids)
        return F.linear(hidden, model.lm_head.weight).float()  # not lm_head(): a packed head has no backward


def train_qat(model: nn.Module, teacher: nn.Module, params: list[nn.Parameter], batches: Iterable[torch.Tensor],
              steps: int, lr: float = 1e-5, warmup: int = 10, bf16: bool = False,
              on_step: Optional[Callable[[int, float], None]] = None) -> list[float]:
    """Adam on `params` (from prepare_qat) against the teacher's logits, cosine decay; returns each step's loss.

    batches yields token ids [batch, seq] and is cycled until `steps` steps are done.
    """
    if steps <= 0 or lr <= 0:
        raise ValueError(f"steps and lr must be positive, got steps={steps!r}, lr={lr!r}")
    opt = torch.optim.Adam(params, lr=lr)
    model.train()

    def batch_loss(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = logits_of(teacher, ids, bf16)
        return distillation_loss(logits_of(model, ids, bf16), target)

    losses = run_training(opt, batches, steps, warmup, batch_loss, on_step)
    model.eval()
    return losses


@torch.no_grad()
def model_perplexity(model: nn.Module, token_ids: list[int], window: int = 512, stride: int = 256,
                     bf16: bool = False) -> float:
    """Perplexity of a bare model (no engine) on token_ids, scored window by window as `minfer.lab.evaluate`
    does (its context_windows): for watching a training run. Reported numbers use `minfer.lab.evaluate.perplexity`."""
    total, count = 0.0, 0
    for start, end, first in context_windows(len(token_ids), window, stride):
        ids = torch.tensor([token_ids[start:end]], device=model.embed_tokens.weight.device)
        logp = F.log_softmax(logits_of(model, ids, bf16)[0, first - start - 1:-1], dim=-1)
        total -= logp.gather(-1, ids[0, first - start:, None]).sum().item()
        count += end - first
    return math.exp(total / count)


@torch.no_grad()
def quantization_errors(float_model: nn.Module, model: nn.Module) -> dict[str, float]:
    """Relative error ||W_model - W_float|| / ||W_float|| per kind of matrix, over all layers.

    `model` may be quantized (its layers' `dequantize()`) or float (e.g. fake-quantized weights)."""
    sq_error, sq_norm = dict.fromkeys(LINEAR_NAMES, 0.0), dict.fromkeys(LINEAR_NAMES, 0.0)
    for (i, block, name), (_, ref_block, _) in zip(_linears(model), _linears(float_model)):
        layer, reference = getattr(block, name), getattr(ref_block, name).weight.float()
        w = layer.dequantize() if hasattr(layer, "dequantize") else layer.weight.float()
        sq_error[name] += (w - reference).pow(2).sum().item()
        sq_norm[name] += reference.pow(2).sum().item()
    return {name: math.sqrt(sq_error[name] / sq_norm[name]) for name in LINEAR_NAMES}
