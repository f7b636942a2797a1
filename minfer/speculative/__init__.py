"""Speculative decoding: guess cheaply, check expensively, keep exactly the target's distribution.

At batch size 1 a decode step is bound by reading the weights, not by arithmetic, so the target
can score k+1 positions in one pass for about the price of one. A cheap proposer guesses k
tokens; the target verifies them all at once; the accepted ones plus one more token come out
of a single target pass.

    proposer.py    the interface: propose(seqs, num_tokens) -> [(token ids, draft probs or None)]
    ngram.py       prompt lookup: continue the latest earlier match of the last n tokens
    draft_model.py a small model with the same vocabulary, in a paged KV pool of its own, every sequence in one batch
    rejection.py   the acceptance rule (lossless) and greedy verification
    stats.py       acceptance rate, mean acceptance length, acceptance per position
    pruned_draft.py the shipped draft's shape (target layers, pruned; a top-K head), saved and loaded by name
    eagle_head.py  an EAGLE head: one decoder layer reading the target's features, saved and loaded by name
    eagle.py       the EAGLE proposer: the target's features per sequence, the head's cache, chained guesses
    batched_drafting.py what both share: every sequence drafted at once, a paged pool of their own, CUDA graphs

How the draft was trained (distillation loss, teacher top-k, the training loop; chapter 08) is course code:
`minfer/lab/distill.py`.

    LLM("smollm2-135m", speculative_model="[ngram]", num_speculative_tokens=4)
    LLM("smollm2-135m", speculative_model="smollm2-135m-eagle", num_speculative_tokens=4)
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from minfer.config import EagleDraft, NgramLookup
from minfer.models.llama import LlamaModel
from minfer.models.loader import KNOWN_MODELS, load_model
from minfer.speculative.draft_model import DraftModelProposer
from minfer.speculative.eagle import EagleProposer
from minfer.speculative.eagle_head import EagleHead, is_eagle, load_eagle
from minfer.speculative.ngram import NgramProposer, ngram_lookup
from minfer.speculative.proposer import Proposal, Proposer
from minfer.speculative.pruned_draft import load_draft
from minfer.speculative.rejection import greedy_verify, processed_probs, rejection_sample, verify
from minfer.speculative.stats import SpecDecodeStats

__all__ = ["Proposer", "Proposal", "NgramProposer", "DraftModelProposer", "EagleProposer", "SpecDecodeStats", "make_proposer",
           "ngram_lookup", "rejection_sample", "greedy_verify", "processed_probs", "verify"]


def make_proposer(speculative_model, target: LlamaModel, tokenizer, max_model_len: int, dtype: torch.dtype,
                  device: torch.device) -> Optional[Proposer]:
    """A Proposer -> itself; '[ngram]' -> NgramProposer; a LlamaModel, a model name/path, or a shipped draft name
    (minfer.speculative.pruned_draft, e.g. 'smollm2-135m-draft') -> DraftModelProposer; an EagleHead, or an EAGLE head's
    name or folder ('smollm2-135m-eagle', minfer.speculative.eagle_head) -> EagleProposer; an NgramLookup (speculative_config's
    n-gram sizes, `minfer.config`) -> NgramProposer with those sizes; an EagleDraft (speculative_config's method
    "eagle") -> EagleProposer, refused unless it names an EAGLE head; None -> None."""
    if speculative_model is None or isinstance(speculative_model, Proposer):
        return speculative_model
    if isinstance(speculative_model, NgramLookup):
        return NgramProposer(speculative_model.prompt_lookup_max, speculative_model.prompt_lookup_min)
    if speculative_model == "[ngram]":
        return NgramProposer()
    if isinstance(speculative_model, EagleDraft):
        speculative_model = speculative_model.model
        if not (isinstance(speculative_model, EagleHead) or (isinstance(speculative_model, str) and is_eagle(speculative_model))):
            raise ValueError(f"speculative_config method 'eagle' needs an EAGLE head (such as 'smollm2-135m-eagle', or a folder "
                             f"saved by minfer.speculative.eagle_head.save_eagle), got {speculative_model!r}; a whole draft "
                             "model takes method 'draft_model'")
    if isinstance(speculative_model, EagleHead) or (isinstance(speculative_model, str) and is_eagle(speculative_model)):
        head = speculative_model if isinstance(speculative_model, EagleHead) else load_eagle(speculative_model, target)
        _check_eagle(head, target)
        return EagleProposer(head, target.config.vocab_size)
    if isinstance(speculative_model, LlamaModel):
        draft = speculative_model
    else:
        draft = _load_draft(str(speculative_model), target, tokenizer, dtype, device)
    _check_draft(draft, target, max_model_len)
    return DraftModelProposer(draft, target.config.vocab_size)


def _load_draft(name: str, target: LlamaModel, tokenizer, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    if name in KNOWN_MODELS or (os.path.exists(name) and not _is_draft_folder(name)):
        loaded = load_model(name, dtype)
        if loaded.tokenizer is not None and loaded.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"speculative_model {name!r} has a different tokenizer from the target's: "
                             "the draft must share the target's vocabulary")
        return LlamaModel.from_weights(loaded.config, loaded.weights, dtype, device)
    return load_draft(name, target, dtype, device)  # a shipped distilled draft (chapter 08), or a folder of one


def _is_draft_folder(path: str) -> bool:
    """A folder written by minfer.speculative.pruned_draft.save_draft (its config.json lists the head's token ids)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return "head_token_ids" in json.load(f)


def _check_eagle(head: EagleHead, target: LlamaModel) -> None:
    if head.config.hidden_size != target.config.hidden_size:
        raise ValueError(f"the EAGLE head reads features of size {head.config.hidden_size}, the target's are "
                         f"{target.config.hidden_size}: an EAGLE head only fits the model it was trained on")
    if head.fc.weight.dtype != target.embed_tokens.weight.dtype or head.fc.weight.device != target.embed_tokens.weight.device:
        raise ValueError(f"the EAGLE head ({head.fc.weight.dtype}, {head.fc.weight.device}) must have the target's dtype "
                         f"and device ({target.embed_tokens.weight.dtype}, {target.embed_tokens.weight.device})")


def _check_draft(draft: LlamaModel, target: LlamaModel, max_model_len: int) -> None:
    head = getattr(draft, "head_token_ids", None)
    vocab = target.config.vocab_size
    if head is None and draft.config.vocab_size != vocab:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                         f"({vocab}): a draft must use the target's tokenizer")
    if head is not None and (head.ndim != 1 or head.numel() != draft.lm_head.weight.shape[0]
                             or int(head.min()) < 0 or int(head.max()) >= vocab):
        raise ValueError(f"the draft's head_token_ids must be one target token id in [0, {vocab}) per output row")
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft handles {draft.config.max_position_embeddings} positions, fewer than the target's "
                         f"context window ({max_model_len}): lower max_model_len")
    if draft.embed_tokens.weight.device != target.embed_tokens.weight.device:
        raise ValueError("the draft and the target must be on the same device")
