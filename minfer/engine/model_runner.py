"""The model runner: a scheduled batch in, logits and next tokens out.

It owns everything a step needs on the device, so that the engine above it only deals in
sequences and tokens:

* the KV pool, sized here from the engine config (the blocks that fit the memory budget);
* the step's tensors (`prepare`): the new tokens of every scheduled sequence packed into one row,
  their positions, the KV slot each one is written to, and each sequence's block table and length;
  the row padded to a fixed bucket size, so that the matmuls meet few shapes (`buckets.py`);
* the attention path: the Triton kernels on CUDA, the gather path on CPU or when a learner's
  attention function replaced the model's (the kernels cannot call it);
* the forward pass, with logits only where someone reads them;
* batched sampling: one call draws the next token of every sequence that gets one, each row with
  its own settings and its own random numbers (`draws` decides who and how, before the forward pass ends);
* the decode path, chosen once: decode steps and speculative verification passes replayed as CUDA graphs
  on CUDA (`cuda_graphs.py`, the default there), plain decode steps through the compiled model with
  enforce_eager=False elsewhere (`compiled_decode.py`), or eager.

    runner = ModelRunner(model, config)
    step = runner.run(batch)        # batch: [(sequence, new tokens), ...] from the scheduler
    step.tokens                     # the next token of each plain sequence in step.sampled

`run` does it all and reads the tokens back; async scheduling (`overlap.py`) calls prepare, draws and forward
itself and reads them later.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from minfer.config import CPU_KV_CACHE_BYTES, EngineConfig
from minfer.engine.block_tables import BlockTables
from minfer.engine.buckets import bucket_for
from minfer.engine.compiled_decode import CompiledDecode
from minfer.engine.cuda_graphs import DecodeGraphs
from minfer.engine.paged_kv import KVPool, PagedStep, SequenceSlice
from minfer.host_copy import to_device
from minfer.layers.attention import attention_sdpa
from minfer.layers.sampler import SamplingTensors, sample
from minfer.models.llama import LlamaModel
from minfer.sequence import Sequence


@dataclass
class StepOutput:
    """What one forward pass produced, row by row.

    sampled: the sequences that reached the end of what they know, each with its consecutive
    logits rows: 1 + its number of draft tokens (the drafts are verified by the engine).
    tokens: the sampled next token of each sampled sequence without drafts (None for the others).
    scored: (sequence, first, last) prompt positions whose logits follow the sampled rows, for
    prompt_logprobs. logits: float32 [rows, vocab].
    hidden: with keep_hidden, (sequence, first position, pre-norm hidden states [new tokens, hidden], the
    hidden_layers' outputs first) for
    every scheduled sequence: what an EAGLE draft head reads (`minfer.speculative.eagle`).
    """

    sampled: list[tuple[Sequence, slice]]
    tokens: list[Optional[int]]
    scored: list[tuple[Sequence, int, int]]
    logits: torch.Tensor
    num_tokens: int  # the scheduled tokens run through the model
    num_padding: int = 0  # rows added to reach the step's bucket size
    hidden: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class PreparedStep:
    """The tensors of one step, and which logits rows belong to whom."""

    input_ids: torch.Tensor  # [1, tokens + padding]
    positions: torch.Tensor  # [1, tokens + padding]
    paged: PagedStep
    logits_indices: torch.Tensor  # the rows to compute logits for: sampling rows, then prompt-scoring rows
    sampled: list[tuple[Sequence, slice]] = field(default_factory=list)  # logits rows of each sampled sequence
    scored: list[tuple[Sequence, int, int]] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)  # the scheduled sequences in paged.slices' order (prepare sorts)
    hidden_layers: Optional[tuple[int, ...]] = None  # hidden states wanted too, after these layers' outputs; None: not
    # async scheduling: input_ids[0, pending_rows] are the previous step's draws[pending_from], still on the device
    pending_rows: Optional[torch.Tensor] = None
    pending_from: Optional[torch.Tensor] = None

    @property
    def plain_decode(self) -> bool:
        """One new token per sequence and nothing else to compute: the step a compiled model serves."""
        return (not self.scored and all(s.query_len == 1 for s in self.paged.slices)
                and len(self.sampled) == len(self.paged.slices) and all(not s.spec_token_ids for s, _ in self.sampled))


def blocks_per_sequence(config: EngineConfig) -> int:
    """The most KV blocks one sequence can hold: max_model_len tokens and room for its speculative guesses."""
    return -(-(config.max_model_len + (config.num_speculative_tokens or 0) + 1) // config.block_size)


def max_usable_blocks(config: EngineConfig) -> int:
    """The most KV blocks the running sequences can hold at once: max_num_seqs sequences of
    `blocks_per_sequence`. A bigger pool would only keep more freed blocks for prefix-cache hits."""
    return config.max_num_seqs * blocks_per_sequence(config)


def profiles_memory(config: EngineConfig, device: torch.device) -> bool:
    """Whether ModelRunner's constructor runs a full-size forward pass to size the KV pool (`_blocks_for_memory`):
    on CUDA, when neither a block count nor a memory budget is given."""
    return not config.num_gpu_blocks_override and device.type == "cuda" and config.kv_cache_memory_bytes is None


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, tokens: int, max_model_len: int) -> None:
    """One forward pass over `tokens` tokens without a KV cache: the largest step's activations, for
    measuring their peak memory. Positions wrap at max_model_len: a step may hold more tokens than one
    sequence may (several sequences), but no position may pass the model's rotary table."""
    device = model.embed_tokens.weight.device
    positions = torch.arange(tokens, device=device) % max_model_len
    model(torch.zeros(1, tokens, dtype=torch.long, device=device), positions[None])


class ModelRunner:
    def __init__(self, model: LlamaModel, config: EngineConfig, use_kernels: Optional[bool] = None) -> None:
        """use_kernels: attend with the Triton paged kernels. None (auto): on CUDA, unless the model's
        attention function was replaced (a learner's function needs the gather path that calls it)."""
        self.model, self.config, self.use_kernels = model, config, use_kernels
        weight = model.embed_tokens.weight
        self.device = weight.device
        num_blocks = config.num_gpu_blocks_override or self._blocks_for_memory()
        self.pool = KVPool(model.config, num_blocks, config.block_size, weight.dtype, self.device, config.kv_cache_dtype)
        self.decode_step = self._choose_decode_step()
        # a compiled graph per shape needs buckets (CUDA graphs pad their own buffers)
        self.pad_to_buckets = config.bucket_step_shapes or isinstance(self.decode_step, CompiledDecode)
        self.block_tables = BlockTables(blocks_per_sequence(config), rows=min(config.max_num_seqs, 1024))

    graphs_allowed = True  # False where each step must also run elsewhere (tensor parallelism's workers run eagerly)

    def _choose_decode_step(self) -> Optional[DecodeGraphs | CompiledDecode]:
        """How decode steps run, chosen once: replayed as CUDA graphs (verification passes too), through the
        compiled model, or None (eagerly, like every other step). Both fast paths answer `serves(step)` and `__call__(step)`.

        enforce_eager None (the default, as in vLLM): CUDA graphs on CUDA where a recording can follow
        the step (a dense model on the Triton kernels), else eager; compiling on a CPU costs tens of
        seconds and gained nothing there (docs/benchmarks.md). False: graphs where they can record, else
        the compiled step. True: always eager."""
        eager = self.config.enforce_eager
        graphs = (self.graphs_allowed and self.device.type == "cuda" and DecodeGraphs.supports(self.model)
                  and self.kernels_on())
        if eager is True or (eager is None and not graphs):
            return None
        if graphs:
            return DecodeGraphs(self.model, self.pool, self.config.max_num_seqs, blocks_per_sequence(self.config),
                                max_query_len=1 + (self.config.num_speculative_tokens or 0))
        return CompiledDecode(self.model)

    def _blocks_for_memory(self) -> int:
        """How many KV blocks fit the budget: kv_cache_memory_bytes if given; on CUDA, run one full-size
        step first, then give the cache what is left of utilization x device memory after the weights,
        that step's peak activations and whatever else holds device memory, but no more than the engine
        can ever fill (`max_usable_blocks`: a second engine in the process, or a second server on the
        GPU, still finds room); on CPU 1 GiB."""
        config, weight = self.config, self.model.embed_tokens.weight
        per_block = self.model.config.kv_bytes_per_token(weight.dtype, config.kv_cache_dtype) * config.block_size
        memory = config.kv_cache_memory_bytes
        if profiles_memory(config, self.device):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            profile_forward(self.model, config.max_num_batched_tokens, config.max_model_len)
            free, total = torch.cuda.mem_get_info(self.device)
            elsewhere = total - free - torch.cuda.memory_reserved(self.device)  # other processes, CUDA context
            memory = int(total * config.gpu_memory_utilization) - torch.cuda.max_memory_allocated(self.device) - elsewhere
            memory = min(memory, max_usable_blocks(config) * per_block)
        elif memory is None:
            memory = CPU_KV_CACHE_BYTES
        if memory < per_block:
            raise ValueError(f"the KV cache budget ({memory} bytes) is smaller than one block ({per_block} bytes): "
                             "raise gpu_memory_utilization or kv_cache_memory_bytes")
        return memory // per_block

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def kernels_on(self) -> bool:
        if self.use_kernels is not None:
            return self.use_kernels
        # (an fp8 pool exists on a GPU only from sm_89 on, where Triton compiles e4m3: minfer.formats.hardware)
        return self.device.type == "cuda" and self.model.attention_fn is attention_sdpa

    # ---------------------------------------------------------------- one step
    def prepare(self, batch: list[tuple[Sequence, int]], hidden_layers: Optional[tuple[int, ...]] = None) -> PreparedStep:
        """Pack the scheduled (sequence, new tokens) pairs: prefill chunks first, then decodes by
        increasing context length (the gather path serves decodes of similar lengths together).
        hidden_layers: the step returns hidden states too (`run`'s keep_hidden).

        Per sequence this is a few Python operations on numbers it already holds (a decode brings
        one token, at one position); its block table comes from `BlockTables`, written only where it
        changed. The tensors are made once per step, whatever the batch holds."""
        batch = sorted(batch, key=lambda item: (item[1] == 1, item[0].num_computed if item[1] == 1 else 0))
        input_ids, positions, slices, sample_at, sampled = [], [], [], [], []
        score_at, scored = [], []  # prompt positions whose logits score the next prompt token (prompt_logprobs)
        pending_rows, pending_from = [], []  # (async scheduling) inputs the previous step drew on the device
        for seq, count in batch:
            start, drafts = seq.num_computed, len(seq.spec_token_ids)
            slices.append(SequenceSlice(len(input_ids), count, start + count, seq.block_table))
            if seq.needs_prompt_logits:  # positions [first, last) of this chunk, not scored before a preemption
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(start + count, len(seq.prompt_token_ids) - 1)
                if first < last:
                    score_at += range(len(input_ids) + first - start, len(input_ids) + last - start)
                    scored.append((seq, first, last))
            if seq.num_pending:  # its one new token is the one in flight: a placeholder, filled in on the device
                pending_rows.append(len(input_ids))
                pending_from.append(seq.pending_index)
                input_ids.append(0)
            else:
                input_ids += seq.token_ids_between(start, start + count)  # draft tokens ride along to be verified
            positions += range(start, start + count)
            if start + count == seq.num_tokens + seq.num_pending + drafts:  # all it knows: sample (and verify drafts)
                sampled.append((seq, slice(len(sample_at), len(sample_at) + 1 + drafts)))
                sample_at += range(len(input_ids) - 1 - drafts, len(input_ids))
        device = self.device
        seqs = [seq for seq, _ in batch]
        rows = self.block_tables.rows(seqs)
        tables = self.block_tables.gather(rows, max(len(s.block_table) for s in slices))
        paged = PagedStep(self.pool, slices, torch.tensor(positions), self.kernels_on(), self.config.bucket_step_shapes,
                          tables)
        logits_rows = sample_at + score_at
        if self.pad_to_buckets:  # rows nobody reads: the model's, and the output head's
            padding = bucket_for(len(input_ids)) - len(input_ids)
            input_ids, positions = input_ids + [0] * padding, positions + [0] * padding
            logits_rows = logits_rows + [0] * (bucket_for(len(logits_rows)) - len(logits_rows)) if logits_rows else []
        step = PreparedStep(to_device([input_ids], device), to_device([positions], device), paged,
                            to_device(logits_rows, device, torch.long), sampled, scored, seqs, hidden_layers)
        if pending_rows:
            step.pending_rows, step.pending_from = to_device(pending_rows, device), to_device(pending_from, device)
        return step

    def release(self, seq: Sequence) -> None:
        """A sequence has left the engine: forget its block table's row."""
        self.block_tables.release(seq)

    def run(self, batch: list[tuple[Sequence, int]], mask_logits: Optional[Callable] = None,
            keep_hidden: bool = False, hidden_layers: tuple[int, ...] = ()) -> StepOutput:
        """Prepare, run the model, and sample every sequence that gets a plain next token.

        mask_logits(logits, grammars): forbids, in place, the tokens that each row's grammar (its
        sequence's structured-output matcher, or None) does not allow, before sampling.
        keep_hidden: also return every new token's pre-norm hidden state (StepOutput.hidden).
        hidden_layers: with keep_hidden, earlier layers whose outputs come first in each row (`LlamaModel.hidden_states`)."""
        step = self.prepare(batch, tuple(hidden_layers) if keep_hidden else None)
        draws = self.draws(step)
        logits, states = self.forward(step)
        hidden = ([(seq, s.context_len - s.query_len, states[s.query_start:s.query_start + s.query_len])
                   for seq, s in zip(step.seqs, step.paged.slices)] if keep_hidden else [])
        drawn = []
        if draws.indices:
            rows = logits[draws.rows]  # a copy: logprobs still see the raw logits
            grammars = [step.sampled[i][0].grammar for i in draws.indices]
            if mask_logits is not None and any(g is not None for g in grammars):
                mask_logits(rows, grammars)
            drawn = sample(rows, draws.settings).tolist()
        return step_output(step, draws, logits, drawn, hidden)

    def draws(self, step: PreparedStep) -> "Draws":
        """Who among step.sampled draws a plain next token (no drafts to verify), and with what settings.
        Host work only: it may run before the forward pass has finished."""
        indices = [i for i, (seq, _) in enumerate(step.sampled) if not seq.spec_token_ids]
        seqs = [step.sampled[i][0] for i in indices]
        # the counter is the index of the token drawn: tokens still in flight count (async scheduling)
        settings = SamplingTensors.build([s.params for s in seqs], [s.seed for s in seqs],
                                         [len(s.output_ids) + s.num_pending for s in seqs],
                                         self.model.config.vocab_size, self.device) if seqs else None
        return Draws(indices, to_device([step.sampled[i][1].start for i in indices], self.device, torch.long), settings)

    def forward(self, step: PreparedStep, drawn_before: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The step through the model: (logits at step.logits_indices, the hidden states when
        step.hidden_layers asks, else None). The fast path when it serves the step, else eagerly.
        drawn_before: the previous step's draws, where some inputs are still to come from (async scheduling)."""
        if step.pending_rows is not None:  # a device-side copy: the host never reads these tokens first
            step.input_ids[0, step.pending_rows] = drawn_before[step.pending_from]
        fast = self.decode_step
        served = fast(step) if fast is not None and fast.serves(step) else None
        if served is not None:
            return served
        if step.hidden_layers is not None:  # not a step the fast path serves (or its recording failed): eagerly
            states = self.model.hidden_states(step.input_ids, step.positions, step.paged, keep_layers=step.hidden_layers)[0]
            return self.model.logits(states[step.logits_indices, -self.model.config.hidden_size:]), states
        return self.model(step.input_ids, step.positions, step.paged, logits_indices=step.logits_indices)[0], None


def step_output(step: PreparedStep, draws: "Draws", logits: torch.Tensor, drawn: list[int],
                hidden: Optional[list] = None) -> StepOutput:
    """A run step's StepOutput: drawn[i] is the next token of step.sampled[draws.indices[i]] (the others get None)."""
    tokens: list[Optional[int]] = [None] * len(step.sampled)
    for i, token in zip(draws.indices, drawn):
        tokens[i] = token
    num_tokens = step.paged.num_tokens
    return StepOutput(step.sampled, tokens, step.scored, logits, num_tokens, step.input_ids.shape[1] - num_tokens,
                      hidden or [])


@dataclass
class Draws:
    """The plain next tokens a step draws: which of its sampled sequences (indices), at which logits rows, with
    which settings (`SamplingTensors`; None when all are greedy)."""

    indices: list[int]
    rows: torch.Tensor  # int64, on the device
    settings: Optional[SamplingTensors]
