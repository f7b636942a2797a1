"""The serving engine: requests in, one scheduled step at a time, outputs out.

    engine.add_request(request)           # a minfer.sequence.Request (LLM.add_request makes one)
    while engine.has_unfinished_requests():
        for output in engine.step():      # RequestOutputs of the requests that moved this step
            ...
    engine.abort_request(request_id)      # at any time; its blocks return to the pool

A step: the scheduler picks (sequence, new tokens) pairs; their tokens are packed into one row
with positions and KV slots; one forward pass computes them all through the paged cache; the
sequences that reached the end of what they know sample their next token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minfer.engine.block_manager import BlockManager
from minfer.engine.paged_kv import KVPool, PagedStep, SequenceSlice
from minfer.engine.scheduler import Scheduler
from minfer.layers.attention import attention_sdpa
from minfer.layers.sampler import sample_next_tokens
from minfer.models.llama import LlamaModel
from minfer.outputs import RequestOutput
from minfer.sequence import Request


@dataclass
class EngineStats:
    computed_tokens: int = 0  # tokens run through the model (prefill chunks, recomputes, decodes)
    steps: int = 0
    peak_blocks_used: int = 0


class Engine:
    def __init__(self, model: LlamaModel, tokenizer, eos_token_ids: set[int], num_blocks: int, block_size: int = 16,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, use_kernels: Optional[bool] = None) -> None:
        """use_kernels: attend with the Triton paged kernels. None (auto): on CUDA, unless the model's
        attention function was replaced (a learner's function needs the gather path that calls it)."""
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, eos_token_ids
        self.use_kernels = use_kernels
        weight = model.embed_tokens.weight
        self.pool = KVPool(model.config, num_blocks, block_size, weight.dtype, weight.device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a request: its sequences (n completions of one prompt) share the prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        longest = max(len(s.prompt_token_ids) + s.max_tokens for s in request.seqs)
        if self.blocks.blocks_needed(longest) > self.blocks.num_blocks:
            raise ValueError(f"request {request.request_id} may need {longest} tokens of KV cache, more than the whole "
                             f"pool ({self.blocks.num_blocks} blocks of {self.blocks.block_size}): lower max_tokens or "
                             "give the cache more memory (num_gpu_blocks_override, kv_cache_memory_bytes)")
        self.requests[request.request_id] = request
        for seq in request.seqs:
            seq.request_id = request.request_id
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"

    def _fail(self, request: Request, exc: Exception) -> None:
        """End a request whose processing raised: finish_reason "error", the message as stop_reason."""
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.remove(seq)
                seq.finish_reason, seq.stop_reason = "error", f"{type(exc).__name__}: {exc}"

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens admitted."""
        s = self.scheduler
        return s.cached_prompt_tokens / s.admitted_prompt_tokens if s.admitted_prompt_tokens else 0.0

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("nothing could be scheduled although requests wait: the KV pool is too small")
            return []
        # prefill chunks first, then the decodes, so that PagedStep serves all decodes with one gather
        batch.sort(key=lambda item: item[1] == 1)
        input_ids, positions, slots, slices, sample_at, sampled = [], [], [], [], [], []
        bs = self.blocks.block_size
        for seq, count in batch:
            start = seq.num_computed
            slices.append(SequenceSlice(len(input_ids), count, start + count, seq.block_table))
            input_ids += seq.token_ids[start:start + count]
            positions += range(start, start + count)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + count)]
            if start + count == len(seq.token_ids):  # it has computed all it knows: sample the next token
                sample_at.append(len(input_ids) - 1)
                sampled.append(seq)
        device = self.pool.k.device
        use_kernels = self.use_kernels
        if use_kernels is None:
            use_kernels = device.type == "cuda" and self.model.attention_fn is attention_sdpa
        step = PagedStep(self.pool, slices, torch.tensor(slots, device=device), use_kernels)
        logits = self.model(torch.tensor([input_ids], device=device), torch.tensor([positions], device=device), step,
                            logits_indices=torch.tensor(sample_at, dtype=torch.long, device=device))[0]
        for seq, count in batch:
            seq.num_computed += count
            self.blocks.seal_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        self.stats.computed_tokens += len(input_ids)
        self.stats.steps += 1
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.blocks.num_blocks - self.blocks.num_free_blocks)
        touched = {}
        for row, seq in enumerate(sampled):
            if seq.request_id not in self.requests:  # its request failed earlier in this loop
                continue
            touched[seq.request_id] = self.requests[seq.request_id]
            try:
                (token,) = sample_next_tokens(logits[row:row + 1], [seq.params], [seq.generator])
                seq.append(token, self.tokenizer, self.eos_token_ids)
            except Exception as exc:  # one broken request must not take the batch down
                self._fail(touched[seq.request_id], exc)
                continue
            if seq.finished:
                self.scheduler.remove(seq)
        outputs = []
        for request_id, request in touched.items():
            if request.finished:
                self.requests.pop(request_id, None)
            outputs.append(request.to_output())
        return outputs
