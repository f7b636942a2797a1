"""`LLM`: the public entry point, a compatible subset of vLLM's `vllm.LLM`.

    from minfer import LLM, SamplingParams          # later: from vllm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20))
    print(outputs[0].outputs[0].text)
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Iterator, Optional, Union

import torch
from tqdm.auto import tqdm

from minfer.config import EngineConfig
from minfer.engine.build import build_model, check_combinations, plan
from minfer.engine.engine import Engine
from minfer.engine.parallel import ParallelModelRunner, TensorParallelWorkers
from minfer.generate import generate_static_batch
from minfer.layers.attention import AttentionFn, get_attention_fn
from minfer.layers.sampler import signed_seed
from minfer.metrics import Metric, engine_metrics
from minfer.models.loader import DEFAULT_MODEL, load_model
from minfer.outputs import RequestMetrics, RequestOutput
from minfer.sampling_params import RequestOutputKind, SamplingParams
from minfer.sequence import Request, Sequence

PromptType = Union[str, dict]  # a string, {"prompt": str} or {"prompt_token_ids": [...]} (vLLM's TextPrompt, TokensPrompt)
CHAT_ROLES = ("system", "user", "assistant", "developer")  # "developer": OpenAI's newer name for "system"


def message_text(content: Union[str, list]) -> str:
    """A chat message's content as text: a string as it is, or the text parts of an OpenAI content list
    ([{"type": "text", "text": ...}, ...]) joined by newlines, as vLLM joins them. Images are not supported."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of {{'type': 'text', 'text': str}} parts, got {content!r}")
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message content parts must be {{'type': 'text', 'text': str}}, got {part!r}")
    return "\n".join(part["text"] for part in content)


def check_unicode(text: str, what: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, as JSON's \\ud800 can carry): no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text: {exc.reason} at character {exc.start}") from None


class LLM:
    """Load a model and generate from it.

    model: 'smollm2-135m' (the default, shipped in a package), a .gguf file or a Hugging Face
    directory. attention: 'sdpa', 'reference' or your own function (see `minfer.layers.attention`).
    Every other keyword is an engine argument with vLLM's name, checked by `minfer.config.EngineConfig`
    before anything loads: dtype, device, seed, max_model_len, quantization (None, 'int8', 'int4',
    'awq', 'gptq') and quantization_group_size, kv_cache_dtype ('auto', 'int8', 'fp8' = 'fp8_e4m3'), block_size, the KV pool's
    size (num_gpu_blocks_override, kv_cache_memory_bytes, gpu_memory_utilization), max_num_seqs,
    max_num_batched_tokens, enable_chunked_prefill, enable_prefix_caching, speculative_model with
    num_speculative_tokens, enforce_eager, tensor_parallel_size. An unknown keyword raises TypeError.

    tensor_parallel_size=N splits every layer over N processes (see `minfer.engine.parallel`):
    N must divide the query and KV head counts (1 or 3 for SmolLM2-135M).

    Quantization (see `minfer.quant.linear`): 'int8' per output channel, 'int4' in groups along the
    input (default group: the largest of 32/64/128 dividing the model's sizes, 64 for SmolLM2-135M),
    'awq' the same int4 after activation-aware scales computed at load time on a fixed calibration
    text (`minfer.quant.awq`), 'gptq' the same int4 with GPTQ's codes (`minfer.quant.gptq`). A folder
    written by `minfer.quant.checkpoint` loads quantized as stored, nothing recomputed. The output
    head becomes int8; the embedding stays exact.
    kv_cache_dtype='int8' keeps a float32 scale per token and KV head: about 2x the tokens of
    bfloat16 in the same memory (served by the paged engine, not by batching="static"); 'fp8'
    stores e4m3 with a float32 scale per layer and KV head, calibrated when the engine is built: 2x.

    Speculative decoding (see `minfer.speculative`): speculative_model '[ngram]' (prompt lookup), a model
    name or path with the target's tokenizer, or a shipped draft such as 'smollm2-135m-draft'. The
    output keeps exactly the target's distribution. Metrics: `llm.get_metrics()` (vLLM's counters) or
    `llm.engine.spec_stats` (the same, with acceptance rates and alpha).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, attention: Union[str, AttentionFn] = "sdpa", **engine_args) -> None:
        config = EngineConfig.from_kwargs("LLM()", model=model, **engine_args)
        check_combinations(config, None, None, attention)  # what the arguments alone refuse, before loading
        loaded = load_model(config.model, config.dtype, check_config=config.fit_to_model)
        self.config, self.tokenizer, self.model_path = loaded.config, loaded.tokenizer, loaded.path
        eos = loaded.eos_token_ids  # the generation config's, beside the tokenizer's
        self.device, self.dtype = config.device, config.dtype
        self._seed_stream = torch.Generator().manual_seed(config.seed)
        # the latest output of each request queued with add_request that generate() or stream() stepped: step() hands
        # them over, so that their owners still see every request finish
        self._held_outputs: dict[str, RequestOutput] = {}
        self._request_counter = 0
        build = plan(config, loaded.config, loaded.quantization, attention)  # and what needs the model
        self.tensor_parallel_size = build.tensor_parallel_size
        runner = None
        if build.tensor_parallel_size > 1:  # workers hold the other shards (minfer.engine.parallel)
            workers = TensorParallelWorkers(build, loaded)
            self.model = workers.model
            runner = ParallelModelRunner(self.model, config, workers)
        else:
            self.model = build_model(build, loaded)
        del loaded
        self.engine = Engine(self.model, self.tokenizer, config, runner=runner, eos_token_ids=eos)  # and the draft, if any

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self):
        return self.tokenizer

    def set_attention(self, attention: Union[str, AttentionFn]) -> None:
        """Swap the attention backend (a name or a function with the documented contract)."""
        if self.tensor_parallel_size > 1:
            raise ValueError("set_attention changes rank 0 only: with tensor_parallel_size > 1 pass attention= to LLM()")
        self.model.attention_fn = get_attention_fn(attention)

    def generate(self, prompts: Union[PromptType, list[PromptType]],
                 sampling_params: Union[SamplingParams, list[SamplingParams], None] = None, *,
                 use_tqdm: bool = True, use_cache: bool = True, batching: str = "continuous") -> list[RequestOutput]:
        """Generate completions for one prompt or a list (strings, {"prompt": str} or {"prompt_token_ids": [...]}).

        batching: "continuous" (the serving engine) or "static" (the simple loop of chapters 00-02:
        fixed batches of max_num_seqs, each decoded until its longest member ends). use_cache=False
        recomputes everything every step (static loop only; for the KV-cache lesson).
        """
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
        kv_cache_dtype = self.engine.config.kv_cache_dtype
        if (batching == "static" or not use_cache) and kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} lives in the paged engine: use "
                             "batching='continuous' with use_cache=True, or an LLM with kv_cache_dtype='auto'")
        if (batching == "static" or not use_cache) and self.engine.proposer is not None:
            raise ValueError("speculative decoding runs in the serving engine: use batching='continuous' with "
                             "use_cache=True, or an LLM without speculative_model")
        if (batching == "static" or not use_cache) and self.tensor_parallel_size > 1:
            raise ValueError("tensor parallelism runs in the serving engine: use batching='continuous' with use_cache=True")
        # it returns the requests' last outputs: the engine reports each one once, at its end (as vLLM's LLM does)
        requests = self._make_requests(prompts, sampling_params, output_kind=RequestOutputKind.FINAL_ONLY)
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm or len(requests) < 2)
        if batching == "static" or not use_cache:
            sequences = [seq for request in requests for seq in request.seqs]
            batch_size = self.engine.config.max_num_seqs
            for start in range(0, len(sequences), batch_size):
                batch = sequences[start:start + batch_size]
                for _ in generate_static_batch(self.model, self.tokenizer, batch, self.engine.eos_token_ids, use_cache):
                    pass
                bar.update(sum(any(r.seqs[-1] is s for s in batch) for r in requests))
        else:
            self._add_all(requests)
            try:
                mine, remaining = {r.request_id for r in requests}, len(requests)
                while remaining and self.engine.has_unfinished_requests():  # the engine reports each finish once
                    finished = sum(out.finished for out in self._step_for(mine))
                    bar.update(finished)
                    remaining -= finished
            except BaseException:  # Ctrl-C...: leave the engine clean for the next call
                for request in requests:
                    self.engine.abort_request(request.request_id)
                raise
        bar.close()
        return [r.to_output() for r in requests]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, list[SamplingParams], None] = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        prompts = [self.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every new token (cumulative text, as vLLM streams it); done when it
        finishes. Requests queued with add_request advance in the same steps; step() returns their outputs."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream() generates one completion: n must be 1, got {params.n}")
        request_id = self.add_request(prompt, params)
        try:
            while True:
                held = self._held_outputs.pop(request_id, None)  # it advanced in a step another caller ran
                if held is not None:
                    yield held
                    if held.finished:
                        return
                if not self.engine.has_unfinished_requests():
                    return
                for output in self._step_for({request_id}):
                    yield output
                    if output.finished:
                        return
        finally:  # the caller may stop reading early: free the request's blocks
            self.engine.abort_request(request_id)

    # ------------------------------------------------------------------ the engine, one step at a time
    def add_request(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> str:
        """Queue one request in the serving engine (checked first); returns its request id."""
        (request_id,) = self.add_requests([prompt], sampling_params)
        return request_id

    def add_requests(self, prompts: list[PromptType],
                     sampling_params: Union[SamplingParams, list[SamplingParams], None] = None, *,
                     refuse_beyond_context: bool = False, max_request_tokens: Optional[int] = None) -> list[str]:
        """Queue several requests, all or none: every prompt is checked before the first is queued.

        A max_tokens beyond the context window is cut to what fits (as vLLM's `LLM` does), or with
        refuse_beyond_context refused with a ValueError (as OpenAI-compatible servers do).
        max_request_tokens: refuse (ValueError) a call whose sequences together may hold more tokens
        of KV cache than this, each its prompt and its max_tokens (a server's bound on work per call)."""
        requests = self._make_requests(prompts, sampling_params, refuse_beyond_context)
        if max_request_tokens is not None:
            held = sum(s.num_tokens + s.max_tokens for r in requests for s in r.seqs)
            if held > max_request_tokens:
                raise ValueError(f"this request may hold {held} tokens of KV cache (for each of n completions of "
                                 f"each prompt: prompt + max_tokens), more than the limit of {max_request_tokens}: "
                                 "lower max_tokens or n, or send fewer prompts")
        self._add_all(requests)
        return [r.request_id for r in requests]

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests that got a token in it (of a request whose
        output_kind is FINAL_ONLY: only the last, when it finishes), and, first, the latest
        output of each request that advanced in a generate() or stream() since the last step())."""
        if not self._held_outputs:
            return self.engine.step()
        held, self._held_outputs = self._held_outputs, {}
        for output in self.engine.step():
            held.pop(output.request_id, None)
            held[output.request_id] = output
        return list(held.values())

    def _step_for(self, request_ids: set[str]) -> list[RequestOutput]:
        """One engine step for generate() or stream(): the outputs of request_ids; the others' are held for step()."""
        outputs = []
        for output in self.engine.step():
            if output.request_id in request_ids:
                outputs.append(output)
            else:
                self._held_outputs[output.request_id] = output
        return outputs

    def abort_request(self, request_id: str) -> None:
        """Drop a request at any point; its KV blocks go back to the pool."""
        self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, as vLLM's: the next prompts are computed in full (timing a prefill, say).
        False, and nothing forgotten, while a request still holds KV blocks."""
        return self.engine.blocks.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's gauges and counters now, as vLLM's `LLM.get_metrics()` gives them (`minfer.metrics`):
        queues, KV-cache use, prefix-cache hits, preemptions, and the draft counts with speculative decoding."""
        return engine_metrics(self.engine.snapshot(), {"model_name": self.engine.config.model})

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template writes it; a message's content is a string or a list
        of text parts (`message_text`)."""
        messages = []
        for m in conversation:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ValueError(f"each message must be {{'role': str, 'content': str or text parts}}, got {m!r}")
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f"message {len(messages)} has the role {m['role']!r}; the roles are "
                                 f"{', '.join(repr(r) for r in CHAT_ROLES)}")
            content = message_text(m["content"])
            check_unicode(content, f"the content of message {len(messages)}")
            messages.append({**m, "role": "system" if m["role"] == "developer" else m["role"], "content": content})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True) -> dict:
        """The conversation as a prompt of token ids: the template writes its own special tokens (a BOS
        among them), so its text is encoded without adding any, as vLLM does."""
        text = self.apply_chat_template(conversation, add_generation_prompt)
        return {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False), "prompt": text}

    # ------------------------------------------------------------------ internals
    def _add_all(self, requests: list[Request]) -> None:
        """Queue checked requests; if the engine refuses one (it cannot fit the pool), take back those queued before it."""
        try:
            for index, request in enumerate(requests):
                self.engine.add_request(request)
        except BaseException as exc:
            for request in requests[:index]:  # (not the refused one: its id may be another request's)
                self.engine.abort_request(request.request_id)
            if isinstance(exc, ValueError):  # say which prompt of this call it was: request ids run across calls
                raise ValueError(f"prompt {index}: {exc}") from None
            raise

    def _tokenize(self, prompt: PromptType, index: int) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            prompt = prompt["prompt"]  # vLLM's TextPrompt: the same as the bare string
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty: give at least one character")
            check_unicode(prompt, f"prompt {index}")
            ids = self.tokenizer.encode(prompt)  # with the special tokens the tokenizer adds (Llama's BOS), as vLLM
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.config.vocab_size for t in ids):
                raise ValueError(f"prompt {index}: prompt_token_ids must be a non-empty list of ints in [0, {self.config.vocab_size})")
            ids = list(ids)
        else:
            raise ValueError(f"prompt {index} must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; the context window is {self.max_model_len} "
                             "and at least one must be left to generate")
        return text, ids

    def _make_requests(self, prompts, sampling_params, refuse_beyond_context: bool = False,
                       output_kind: Optional[RequestOutputKind] = None) -> list[Request]:
        """Check every prompt and parameter first, so one bad request fails before any work starts.
        output_kind: given, it replaces the parameters' own (in copies: the caller's objects stay as they are)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a {'prompt': str} or {'prompt_token_ids': [...]} dict, "
                             "or a non-empty list of them")
        params_list = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts: give one, or one per prompt")
        params_list = [p if p is not None else SamplingParams() for p in params_list]
        for i, p in enumerate(params_list):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params {i} must be a SamplingParams, got {type(p).__name__}")
        if output_kind is not None:
            copies = {id(p): dataclasses.replace(p, output_kind=output_kind) for p in params_list}
            params_list = [copies[id(p)] for p in params_list]
        tokenized = [self._tokenize(p, i) for i, p in enumerate(prompts)]
        for i, ((_, ids), params) in enumerate(zip(tokenized, params_list)):
            if refuse_beyond_context and params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                                 f"{len(ids) + params.max_tokens} in all, more than the context window of "
                                 f"{self.max_model_len} tokens; ask for at most {self.max_model_len - len(ids)}")
        requests = []
        for (text, ids), params in zip(tokenized, params_list):
            self._request_counter += 1
            arrival = time.perf_counter()
            room = self.max_model_len - len(ids)
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
            base_seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_stream))
            seqs = [Sequence(ids, params, max_tokens, signed_seed(_sequence_seed(base_seed, index)),
                             RequestMetrics(arrival, num_prompt_tokens=len(ids)), index) for index in range(params.n)]
            request = Request(str(self._request_counter - 1), text, ids, seqs)
            requests.append(request)
        return requests


def _sequence_seed(seed: int, index: int) -> int:
    """Completion 0 uses the seed itself; completions 1..n-1 get independent streams derived from it."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little")
