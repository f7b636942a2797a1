"""The serving engine: requests in, one scheduled step at a time, outputs out.

    engine.add_request(request)           # a minfer.sequence.Request (LLM.add_request makes one)
    while engine.has_unfinished_requests():
        for output in engine.step():      # RequestOutputs of the requests that moved this step
            ...
    engine.abort_request(request_id)      # at any time; its blocks return to the pool

A step: the scheduler picks (sequence, new tokens) pairs; their tokens are packed into one row
with positions and KV slots; one forward pass computes them all through the paged cache; the
sequences that reached the end of what they know sample their next token.

With speculative decoding (a proposer, see minfer/spec), each decoding sequence first gets up to
k draft tokens appended tentatively; its chunk is then 1 + k tokens, the pass returns logits at
all of them, and verification keeps the accepted drafts plus one token and rolls the sequence
back past the rest (num_computed, sealed blocks and block table cover accepted tokens only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from minfer.engine.block_manager import BlockManager
from minfer.engine.paged_kv import KVPool, PagedStep, SequenceSlice
from minfer.engine.scheduler import Scheduler
from minfer.layers.attention import attention_sdpa
from minfer.layers.sampler import sample_next_tokens
from minfer.logprobs import logprobs_of
from minfer.models.llama import LlamaModel
from minfer.outputs import RequestOutput
from minfer.sequence import Request, Sequence
from minfer.spec import Proposer, SpecDecodeStats, verify


@dataclass
class EngineStats:
    computed_tokens: int = 0  # tokens run through the model (prefill chunks, recomputes, decodes)
    steps: int = 0
    peak_blocks_used: int = 0


class Engine:
    def __init__(self, model: LlamaModel, tokenizer, eos_token_ids: set[int], num_blocks: int, block_size: int = 16,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, use_kernels: Optional[bool] = None,
                 kv_cache_dtype: str = "auto", proposer: Optional[Proposer] = None,
                 num_speculative_tokens: int = 0) -> None:
        """use_kernels: attend with the Triton paged kernels. None (auto): on CUDA, unless the model's
        attention function was replaced (a learner's function needs the gather path that calls it).
        kv_cache_dtype: "auto" (the model's dtype) or "int8" (see minfer/formats/kv.py).
        proposer, num_speculative_tokens: speculative decoding (see minfer/spec): every decoding
        sequence gets up to that many draft tokens, verified in the same pass as its last token."""
        self.model, self.tokenizer, self.eos_token_ids = model, tokenizer, eos_token_ids
        self.use_kernels = use_kernels
        weight = model.embed_tokens.weight
        self.pool = KVPool(model.config, num_blocks, block_size, weight.dtype, weight.device, kv_cache_dtype)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.proposer, self.num_speculative_tokens = proposer, num_speculative_tokens
        self.spec_stats = SpecDecodeStats()

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a request: its sequences (n completions of one prompt) share the prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        longest = max(len(s.prompt_token_ids) + s.max_tokens for s in request.seqs)
        p = request.seqs[0].params
        if self.proposer is not None and (p.logprobs is not None or p.prompt_logprobs is not None):
            raise ValueError("logprobs and prompt_logprobs are not supported with speculative decoding: "
                             "make the LLM without speculative_model to get them")
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
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("nothing could be scheduled although requests wait: the KV pool is too small")
            return []
        # prefill chunks first, then the decodes, so that PagedStep serves all decodes with one gather
        batch.sort(key=lambda item: item[1] == 1)
        input_ids, positions, slots, slices, sample_at, sampled = [], [], [], [], [], []
        score_at, scored = [], []  # prompt positions whose logits score the next prompt token (prompt_logprobs)
        bs = self.blocks.block_size
        for seq, count in batch:
            start = seq.num_computed
            slices.append(SequenceSlice(len(input_ids), count, start + count, seq.block_table))
            if seq.needs_prompt_logits:  # positions [first, last) of this chunk, not scored before a preemption
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(start + count, len(seq.prompt_token_ids) - 1)
                if first < last:
                    score_at += range(len(input_ids) + first - start, len(input_ids) + last - start)
                    scored.append((seq, first, last))
            known = seq.token_ids + seq.spec_token_ids  # draft tokens ride along to be verified
            input_ids += known[start:start + count]
            positions += range(start, start + count)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + count)]
            if start + count == len(known):  # it has computed all it knows: sample the next token
                sample_at += range(len(input_ids) - 1 - len(seq.spec_token_ids), len(input_ids))  # (and verify drafts)
                sampled.append(seq)
        device = self.pool.k.device
        use_kernels = self.use_kernels
        if use_kernels is None:
            use_kernels = device.type == "cuda" and self.model.attention_fn is attention_sdpa
        step = PagedStep(self.pool, slices, torch.tensor(slots, device=device), use_kernels)
        logits = self.model(torch.tensor([input_ids], device=device), torch.tensor([positions], device=device), step,
                            logits_indices=torch.tensor(sample_at + score_at, dtype=torch.long, device=device))[0]
        at = len(sample_at)  # the prompt positions' logits follow the sampling rows
        for seq, first, last in scored:
            seq.prompt_logprobs += logprobs_of(logits[at:at + last - first], seq.prompt_token_ids[first + 1:last + 1],
                                               seq.params.prompt_logprobs, self.tokenizer)
            at += last - first
        for seq, count in batch:
            seq.num_computed = min(seq.num_computed + count, len(seq.token_ids))  # drafts count once accepted
            self.blocks.seal_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        self.stats.computed_tokens += len(input_ids)
        self.stats.steps += 1
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.blocks.num_blocks - self.blocks.num_free_blocks)
        touched, row = {}, 0
        for seq in sampled:
            first, row = row, row + 1 + len(seq.spec_token_ids)  # this sequence's logits: rows [first, row)
            if seq.request_id not in self.requests:  # its request failed earlier in this loop
                continue
            touched[seq.request_id] = self.requests[seq.request_id]
            try:
                if seq.spec_token_ids:
                    self._accept_drafts(seq, logits[first:row])
                else:
                    (token,) = sample_next_tokens(logits[first:row], [seq.params], [seq.generator])
                    if seq.logprobs is not None:  # of the raw distribution, before temperature and top-k/p
                        seq.add_logprobs(logprobs_of(logits[first:row], [token], seq.params.logprobs, self.tokenizer)[0])
                    seq.append(token, self.tokenizer, self.eos_token_ids)
            except Exception as exc:  # one broken request must not take the batch down
                self._fail(touched[seq.request_id], exc)
                continue
            if seq.finished:
                self.scheduler.remove(seq)
                if self.proposer is not None:
                    self.proposer.release(seq)
        outputs = []
        for request_id, request in touched.items():
            if request.finished:
                self.requests.pop(request_id, None)
            outputs.append(request.to_output())
        return outputs

    # ---------------------------------------------------------------- speculative decoding
    def _propose(self) -> None:
        """Give each decoding sequence (all computed but its newest token) up to k draft tokens."""
        ready = [s for s in self.scheduler.running if not s.spec_token_ids and s.num_computed == len(s.token_ids) - 1]
        # a pass emits up to k + 1 tokens: never draft past max_tokens (and so past the context window)
        wanted = [min(self.num_speculative_tokens, s.max_tokens - len(s.output_ids) - 1) for s in ready]
        seqs, wanted = [s for s, k in zip(ready, wanted) if k > 0], [k for k in wanted if k > 0]
        if not seqs:
            return
        start = time.perf_counter()
        proposals = self.proposer.propose(seqs, wanted)
        self.spec_stats.draft_time_s += time.perf_counter() - start
        for seq, (tokens, probs) in zip(seqs, proposals):
            seq.spec_token_ids, seq.spec_draft_probs = list(tokens), probs

    def _accept_drafts(self, seq: Sequence, logits: torch.Tensor) -> None:
        """logits [1 + drafts, vocab] at the last known token and each draft: keep what the target
        accepts, emit one more token, and roll the cache back past the rejected drafts."""
        drafts, probs = seq.spec_token_ids, seq.spec_draft_probs
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        emitted = verify(drafts, probs, logits, seq.params, seq.generator)
        self.spec_stats.record(len(drafts), len(emitted) - 1)
        for token in emitted:  # one at a time: EOS, a stop string or max_tokens may end it early
            seq.append(token, self.tokenizer, self.eos_token_ids)
            if seq.finished:
                return
        # the K/V of the accepted drafts are right, a rejected draft's slot will be overwritten:
        # only the newest token remains to compute. Seal blocks over accepted tokens only, and give
        # back blocks that only held rejected drafts.
        seq.num_computed = len(seq.token_ids) - 1
        self.blocks.seal_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        keep = self.blocks.blocks_needed(len(seq.token_ids))
        surplus = seq.block_table[keep:]
        del seq.block_table[keep:]
        self.blocks.free(surplus)
