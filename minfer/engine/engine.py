"""The serving engine: requests in, one scheduled step at a time, outputs out.

    engine = Engine(model, tokenizer, EngineConfig(num_gpu_blocks_override=64))   # or keywords:
    engine = Engine(model, tokenizer, num_gpu_blocks_override=64, max_num_seqs=8)
    engine.add_request(request)           # a minfer.sequence.Request (LLM.add_request makes one)
    while engine.has_unfinished_requests():
        for output in engine.step():      # RequestOutputs of the requests that moved this step
            ...
    engine.abort_request(request_id)      # at any time; its blocks return to the pool

Where a request goes, file by file:

    engine.py        add_request, then every step: schedule -> run -> postprocess
                       (async_scheduling: schedule and launch step n + 1, then postprocess step n; overlap.py)
    scheduler.py       who runs this step and with how many tokens (budget, chunked prefill, preemption)
    block_manager.py   where their K/V live: blocks, reference counts, prefix hashes
    model_runner.py    the step's tensors, the forward pass, batched sampling
    structured_output.py  a requested shape (JSON schema, regex, choice, grammar) as a mask before sampling
    paged_kv.py        the KV pool, and attention over it during the forward pass

With speculative decoding (a proposer, see minfer/speculative), each decoding sequence first gets up to
k draft tokens appended tentatively; its chunk is then 1 + k tokens, the pass returns logits at
all of them, and `_accept_drafts` keeps the accepted drafts plus one token and rolls the sequence
back past the rest (num_computed, sealed blocks and block table cover accepted tokens only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from minfer.config import EngineConfig
from minfer.engine.block_manager import BlockManager
from minfer.engine.kv_calibration import calibration_ids, kv_ranges
from minfer.engine.model_runner import ModelRunner, StepOutput
from minfer.engine.overlap import InFlightStep, launch
from minfer.engine.scheduler import Scheduler
from minfer.engine.snapshot import EngineSnapshot, take_snapshot
from minfer.engine.structured_output import StructuredOutputs
from minfer.host_copy import to_host
from minfer.logprobs import logprobs_of
from minfer.models.llama import LlamaModel
from minfer.models.moe import last_expert_load, moe_blocks
from minfer.outputs import RequestOutput
from minfer.sampling_params import RequestOutputKind
from minfer.sequence import Request, Sequence
from minfer.speculative import Proposer, SpecDecodeStats, make_proposer, verify


@dataclass
class EngineStats:
    computed_tokens: int = 0  # tokens run through the model (prefill chunks, recomputes, decodes)
    padding_tokens: int = 0  # rows added to reach each step's bucket size (minfer.engine.buckets)
    steps: int = 0
    peak_blocks_used: int = 0
    # mixture-of-experts models (minfer.models.moe): token-expert pairs per [sparse layer, expert]
    expert_tokens: Optional[torch.Tensor] = None  # summed over every step
    step_tokens_per_expert: Optional[torch.Tensor] = None  # the last step's
    step_distinct_experts: list[int] = field(default_factory=list)  # experts the last step read, per sparse layer
    distinct_experts_sum: int = 0  # over steps and sparse layers, for the mean
    moe_steps: int = 0

    def record_expert_load(self, load: torch.Tensor) -> None:
        """One step's token-expert pairs, [sparse layers, experts] (padding rows left out), kept on the CPU."""
        load = load.cpu()
        self.step_tokens_per_expert = load
        self.expert_tokens = load if self.expert_tokens is None else self.expert_tokens + load
        self.step_distinct_experts = (load > 0).sum(dim=1).tolist()
        self.distinct_experts_sum += sum(self.step_distinct_experts)
        self.moe_steps += 1

    @property
    def mean_distinct_experts(self) -> float:
        """Experts a step touched (whose weights it read), averaged over steps and sparse layers."""
        layers = len(self.step_distinct_experts)
        return self.distinct_experts_sum / (self.moe_steps * layers) if self.moe_steps else 0.0


class Engine:
    def __init__(self, model: LlamaModel, tokenizer, config: Optional[EngineConfig] = None, *,
                 use_kernels: Optional[bool] = None, runner: Optional[ModelRunner] = None,
                 eos_token_ids: Iterable[int] = (), **engine_args) -> None:
        """config: an EngineConfig, or its fields as keywords (vLLM's names; see `minfer.config`).
        With config.speculative_model (a name, a model, or a `Proposer` of your own), every decoding
        sequence gets up to config.num_speculative_tokens draft tokens, verified in the same pass as
        its last token (see minfer/speculative). use_kernels: see `ModelRunner` (None: the Triton kernels on CUDA).
        runner: a model runner made already (tensor parallelism's, `minfer.engine.parallel`).
        eos_token_ids: more tokens that end a sequence beside the tokenizer's eos_token_id (a
        checkpoint's generation_config.json lists them)."""
        if config is not None and engine_args:
            raise TypeError(f"give an EngineConfig or keywords, not both (got {sorted(engine_args)})")
        config = config or EngineConfig.from_kwargs("Engine()", **engine_args)
        config.fit_to_model(model.config)
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.eos_token_ids = {t for t in (tokenizer.eos_token_id, *eos_token_ids) if t is not None}
        self.runner = runner or ModelRunner(model, config, use_kernels)
        # fp8's static scales, from a calibration text (a runner made elsewhere, tensor parallelism's,
        # keeps its pools' scales at 1, vLLM's default without calibrated scales)
        if runner is None and config.kv_cache_dtype == "fp8":
            self.runner.pool.calibrate_fp8(*kv_ranges(model, calibration_ids(tokenizer, config.max_model_len)))
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.moe_blocks = moe_blocks(model)  # their routing feeds stats.expert_tokens
        self.proposer: Optional[Proposer] = make_proposer(config.speculative_model, model, tokenizer,
                                                          config.max_model_len, config.dtype, config.device)
        self.num_speculative_tokens = config.num_speculative_tokens or 0
        self.spec_stats = SpecDecodeStats()
        self.last_batch: list[tuple[Sequence, int]] = []  # the last step's (sequence, tokens): what views show
        self.last_padding = 0  # rows the last step added to reach its bucket
        self.structured_outputs = StructuredOutputs(tokenizer, model.config.vocab_size, self.eos_token_ids)
        self._snapshots = 0
        self.in_flight: Optional[InFlightStep] = None  # async scheduling: the step launched, not read yet

    # ---------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a request: its sequences (n completions of one prompt) share the prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        longest = max(len(s.prompt_token_ids) + s.max_tokens for s in request.seqs)
        if longest > self.config.max_model_len:  # (LLM cuts max_tokens to fit; a Request made by hand may not)
            raise ValueError(f"request {request.request_id} may reach {longest} tokens (prompt + max_tokens), more than "
                             f"max_model_len {self.config.max_model_len}: lower max_tokens or shorten the prompt")
        p = request.seqs[0].params
        if self.proposer is not None and (p.logprobs is not None or p.prompt_logprobs is not None):
            raise ValueError("logprobs and prompt_logprobs are not supported with speculative decoding: "
                             "make the LLM without speculative_model to get them")
        if p.structured_outputs is not None:
            if self.config.async_scheduling:
                raise ValueError("structured_outputs is not supported with async_scheduling: the mask needs the previous "
                                 "token on the host; make the LLM without async_scheduling to use it")
            if self.proposer is not None:
                raise ValueError("structured_outputs is not supported with speculative decoding: make the LLM without "
                                 "speculative_model to use it")
            for seq, matcher in zip(request.seqs, self.structured_outputs.matchers(p.structured_outputs, len(request.seqs))):
                seq.grammar = matcher
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
                self._retire(seq)
                seq.finish_reason = "abort"

    def _fail(self, request: Request, exc: Exception) -> None:
        """End a request whose processing raised: finish_reason "error", the message as stop_reason."""
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            if not seq.finished:
                self._retire(seq)
                seq.finish_reason, seq.stop_reason = "error", f"{type(exc).__name__}: {exc}"

    def _retire(self, seq: Sequence) -> None:
        """A sequence leaves the engine (finished, aborted or failed): its blocks, its row of block tables."""
        self.scheduler.remove(seq)
        self.runner.release(seq)
        if self.proposer is not None:  # a draft's cache, an EAGLE head's features
            self.proposer.release(seq)

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens admitted."""
        s = self.scheduler
        return s.cached_prompt_tokens / s.admitted_prompt_tokens if s.admitted_prompt_tokens else 0.0

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    def snapshot(self, detail: bool = False) -> EngineSnapshot:
        """The state now, frozen (call it on the thread that steps the engine; see snapshot.py).
        detail: also every sequence, block and the last step's batch (for views that draw them)."""
        self._snapshots += 1
        return take_snapshot(self, self._snapshots, detail)

    # ---------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        if self.config.async_scheduling:
            return self._step_overlapped()
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("nothing could be scheduled although requests wait: the KV pool is too small")
            return []
        self.last_batch = batch
        keep_hidden = self.proposer is not None and self.proposer.needs_hidden_states
        output = self.runner.run(batch, self.structured_outputs.mask, keep_hidden=keep_hidden,
                                 hidden_layers=self.proposer.feature_layers if keep_hidden else ())
        for seq, first, hidden in output.hidden:  # an EAGLE head reads the target's features
            self.proposer.observe(seq, first, hidden)
        if self.moe_blocks:
            self.stats.record_expert_load(self._expert_load(output.num_tokens))
        self._advance(batch, output.num_tokens)
        return self._finish_step(output)

    def _step_overlapped(self) -> list[RequestOutput]:
        """async_scheduling: schedule and launch the next step, then read the one in flight and report
        its outputs (minfer.engine.overlap)."""
        batch = self.scheduler.schedule()
        previous = self.in_flight
        if batch:
            # a launch that raises changes nothing but the schedule (as a failed synchronous step): the step
            # in flight stays in flight, to be read by the next call
            launched = launch(self.runner, batch, previous)
            self.in_flight, self.last_batch = launched, batch
            num_tokens = launched.step.paged.num_tokens
            if self.moe_blocks:  # the routing's counts, on their way to the host before the next step routes
                launched.expert_load = to_host(self._expert_load(num_tokens))
            self._advance(batch, num_tokens)
            for index, (seq, _) in enumerate(launched.step.sampled):
                seq.num_pending += 1
                seq.pending_index = index
        else:
            self.in_flight = None
        if previous is None:
            if not batch and self.scheduler.has_unfinished():
                raise RuntimeError("nothing could be scheduled although requests wait: the KV pool is too small")
            return []
        outputs = self._read(previous)
        if self.in_flight is not None and not self.scheduler.has_unfinished():
            # only rows of sequences that have ended are in flight (a stop token's wasted row): read them now,
            # so that an engine with nothing left to do holds no step
            last, self.in_flight = self.in_flight, None
            outputs += self._read(last)
        return outputs

    def _read(self, launched: InFlightStep) -> list[RequestOutput]:
        """A launched step's tokens, read and reported (async_scheduling)."""
        output = launched.result()
        if launched.expert_load is not None:
            self.stats.record_expert_load(launched.expert_load.wait())
        for seq, _ in output.sampled:
            seq.num_pending -= 1
        outputs = self._finish_step(output)
        for seq, _ in output.sampled:  # a computed block that its new token completed is sealed now that the token is known
            known = min(seq.num_computed, seq.num_tokens)
            if known and known % self.blocks.block_size == 0 and not seq.finished:
                self.blocks.seal_full_blocks(seq.block_table, seq.token_ids, known)
        return outputs

    def _expert_load(self, num_tokens: int) -> torch.Tensor:
        return last_expert_load(self.moe_blocks, num_tokens, self.model.config.num_experts)

    def _finish_step(self, output: StepOutput) -> list[RequestOutput]:
        """A step's results: prompt logprobs, then its tokens (see _postprocess)."""
        failed = self._score_prompts(output)
        for request, exc in failed:
            self._fail(request, exc)
        self.stats.padding_tokens += output.num_padding
        self.last_padding = output.num_padding
        return self._postprocess(output, {request.request_id: request for request, _ in failed})

    def _score_prompts(self, output: StepOutput) -> list[tuple[Request, Exception]]:
        """prompt_logprobs: the logits at prompt positions follow the sampling rows. Returns the
        requests whose scoring raised: each fails alone, once the step's tokens are counted."""
        at, failed = output.sampled[-1][1].stop if output.sampled else 0, []
        for seq, first, last in output.scored:
            if seq.finished:  # (async scheduling) its request failed or was aborted while this step was in flight
                at += last - first
                continue
            try:
                seq.prompt_logprobs += logprobs_of(output.logits[at:at + last - first],
                                                   seq.prompt_token_ids[first + 1:last + 1],
                                                   seq.params.prompt_logprobs, self.tokenizer)
            except Exception as exc:
                failed.append((self.requests[seq.request_id], exc))
            at += last - first
        return failed

    def _advance(self, batch: list[tuple[Sequence, int]], num_tokens: int) -> None:
        """The scheduled tokens are in the cache now: count them, and seal the blocks they filled."""
        block_size = self.blocks.block_size
        for seq, count in batch:
            before = seq.num_computed
            seq.num_computed = min(before + count, seq.num_tokens + seq.num_pending)  # drafts count once accepted
            known = min(seq.num_computed, seq.num_tokens)  # a token in flight is sealed once it is read
            if known // block_size > before // block_size:  # a block filled up
                self.blocks.seal_full_blocks(seq.block_table, seq.token_ids, known)
        self.stats.computed_tokens += num_tokens
        self.stats.steps += 1
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.blocks.num_blocks - self.blocks.num_free_blocks)

    def _postprocess(self, output: StepOutput, failed: dict[str, Request]) -> list[RequestOutput]:
        """Append each sampled token (or the accepted drafts), finish what is done, report who moved
        (the requests that failed earlier in the step among them)."""
        touched = dict(failed)
        for (seq, rows), token in zip(output.sampled, output.tokens):
            request = self.requests.get(seq.request_id)
            if request is None or seq.finished:  # its request failed earlier in this loop, or (async scheduling)
                continue  # it finished while this step was in flight
            touched[seq.request_id] = request
            try:
                if seq.spec_token_ids:
                    self._accept_drafts(seq, output.logits[rows])
                else:
                    if seq.logprobs is not None:  # of the raw distribution, before temperature and top-k/p
                        seq.add_logprobs(logprobs_of(output.logits[rows], [token], seq.params.logprobs, self.tokenizer)[0])
                    seq.append(token, self.tokenizer, self.eos_token_ids)
            except Exception as exc:  # one broken request must not take the batch down
                self._fail(request, exc)
                continue
            if seq.finished:
                self._retire(seq)
        outputs = []
        for request_id, request in touched.items():
            if request.finished:
                self.requests.pop(request_id, None)
            elif request.seqs[0].params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue  # no output until it finishes: none is built
            outputs.append(request.to_output())
        return outputs

    # ---------------------------------------------------------------- speculative decoding
    def _propose(self) -> None:
        """Give each decoding sequence (all computed but its newest token) up to k draft tokens."""
        ready = [s for s in self.scheduler.running if not s.spec_token_ids and s.num_computed == s.num_tokens - 1]
        # a pass emits up to k + 1 tokens: never draft past max_tokens (and so past the context window)
        wanted = [min(self.num_speculative_tokens, s.max_tokens - len(s.output_ids) - 1) for s in ready]
        seqs, wanted = [s for s, k in zip(ready, wanted) if k > 0], [k for k in wanted if k > 0]
        if not seqs:
            return
        start = time.perf_counter()
        proposals = self.proposer.propose(seqs, wanted)
        self.spec_stats.draft_time_s += time.perf_counter() - start
        for seq, k, (tokens, probs) in zip(seqs, wanted, proposals):
            if len(tokens) > k:  # (past k a pass could run beyond max_tokens, and the context window)
                raise RuntimeError(f"{type(self.proposer).__name__}.propose gave {len(tokens)} draft tokens for a "
                                   f"sequence that asked for at most {k}")
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
        seq.num_computed = seq.num_tokens - 1
        self.blocks.seal_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        keep = self.blocks.blocks_needed(seq.num_tokens)
        surplus = seq.block_table[keep:]
        del seq.block_table[keep:]
        self.blocks.free(surplus)
