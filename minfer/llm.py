"""`LLM`: the public entry point, a compatible subset of vLLM's `vllm.LLM`.

    from minfer import LLM, SamplingParams          # later: from vllm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20))
    print(outputs[0].outputs[0].text)
"""
from __future__ import annotations

import hashlib
import time
from typing import Iterator, Optional, Union

import torch
from tqdm.auto import tqdm

from minfer.engine.engine import Engine
from minfer.engine.paged_kv import KVPool, check_kv_cache_dtype
from minfer.generate import generate_static_batch
from minfer.layers.attention import AttentionFn, get_attention_fn
from minfer.models.llama import LlamaModel
from minfer.models.loader import DEFAULT_MODEL, load_model
from minfer.outputs import RequestMetrics, RequestOutput
from minfer.quant.awq import calibration_token_ids
from minfer.quant.linear import check_quantization_args, quantize_model
from minfer.sampling_params import SamplingParams
from minfer.sequence import Request, Sequence
from minfer.spec import check_speculative_args, make_proposer

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
PromptType = Union[str, dict]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda'") from exc


def resolve_dtype(dtype: Union[str, torch.dtype], device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # bfloat16 where the hardware is made for it; float32 on CPU, for exactness
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'")
    return DTYPES[dtype]


class LLM:
    """Load a model and generate from it.

    model: 'smollm2-135m' (the default, shipped in a package), a .gguf file or a Hugging Face
    directory. dtype: 'auto' | 'float32' | 'bfloat16' | 'float16'. device: 'auto' | 'cpu' | 'cuda'.
    max_model_len: the context window (default: the model's). seed: seeds requests that bring no
    seed of their own. attention: 'sdpa', 'reference' or your own function (see
    `minfer.layers.attention`).

    Weight quantization (see `minfer.quant.linear`): quantization None, 'int8' (per output
    channel) or 'int4' (groups along the input; quantization_group_size 32, 64 or 128, default the
    largest that divides the model's sizes: 64 for SmolLM2-135M, whose hidden size 576 is not a
    multiple of 128). The output head becomes int8 in both; the embedding stays exact.
    quantization='awq': the same int4 (and group sizes) after activation-aware scales, computed
    at load time on a fixed calibration text, are folded into the model (`minfer.quant.awq`).

    The serving engine (vLLM's names): block_size (tokens per KV block), max_num_seqs (sequences
    per step), max_num_batched_tokens (tokens per step), enable_prefix_caching,
    enable_chunked_prefill, and the KV pool's size: num_gpu_blocks_override (blocks, on any
    device), else kv_cache_memory_bytes, else on CUDA gpu_memory_utilization x device memory
    minus what is in use, on CPU 1 GiB. kv_cache_dtype: 'auto' (the model's dtype) or 'int8' (a
    float32 scale per token and KV head; about 2x the tokens of bfloat16 in the same memory; served
    by the paged engine, not by batching="static").

    Speculative decoding (vLLM's names; see `minfer.spec`): speculative_model '[ngram]' (prompt
    lookup), a model name or path with the target's tokenizer, or a shipped draft such as
    'smollm2-135m-draft'; num_speculative_tokens: draft tokens per step, 1-16. The output keeps
    exactly the target's distribution. Metrics: `llm.engine.spec_stats`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: Union[str, torch.dtype] = "auto", device: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 32, seed: int = 0,
                 attention: Union[str, AttentionFn] = "sdpa", block_size: int = 16,
                 max_num_batched_tokens: Optional[int] = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, gpu_memory_utilization: float = 0.9,
                 num_gpu_blocks_override: Optional[int] = None, kv_cache_memory_bytes: Optional[int] = None,
                 kv_cache_dtype: str = "auto", speculative_model=None,
                 num_speculative_tokens: Optional[int] = None, quantization: Optional[str] = None,
                 quantization_group_size: Optional[int] = None) -> None:
        check_quantization_args(quantization, quantization_group_size)
        check_kv_cache_dtype(kv_cache_dtype)
        check_speculative_args(speculative_model, num_speculative_tokens)
        self.kv_cache_dtype = kv_cache_dtype
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        for name, value in [("max_num_seqs", max_num_seqs), ("block_size", block_size),
                            ("max_num_batched_tokens", max_num_batched_tokens or 1),
                            ("num_gpu_blocks_override", num_gpu_blocks_override or 1),
                            ("kv_cache_memory_bytes", kv_cache_memory_bytes or 1)]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        loaded = load_model(model, self.dtype)
        self.config, self.tokenizer, self.model_path = loaded.config, loaded.tokenizer, loaded.path
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not (isinstance(max_model_len, int) and 1 <= max_model_len <= limit):
            raise ValueError(f"max_model_len must be an integer in [1, {limit}] for this model, got {max_model_len!r}")
        self.max_model_len = max_model_len or limit
        self.max_num_seqs = max_num_seqs
        self.model = LlamaModel.from_weights(self.config, loaded.weights, self.dtype, self.device)
        if quantization is not None:
            calibration = calibration_token_ids(self.tokenizer) if quantization == "awq" else None
            quantize_model(self.model, quantization, quantization_group_size, calibration_token_ids=calibration)
        del loaded
        self.set_attention(attention)
        self.eos_token_ids = {t for t in (self.tokenizer.eos_token_id,) if t is not None}
        self._seed_stream = torch.Generator().manual_seed(seed)
        self._request_counter = 0
        if max_num_batched_tokens is None:  # a whole prompt per step if prompts cannot be chunked
            max_num_batched_tokens = 512 if enable_chunked_prefill else self.max_model_len
        if not enable_chunked_prefill and max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill, max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.max_model_len}), or the longest prompts could never run")
        num_blocks = num_gpu_blocks_override or self._blocks_for_memory(block_size, kv_cache_memory_bytes,
                                                                        gpu_memory_utilization, max_num_batched_tokens)
        proposer = make_proposer(speculative_model, self.model, self.tokenizer, self.max_model_len, self.dtype,
                                 self.device)
        self.engine = Engine(self.model, self.tokenizer, self.eos_token_ids, num_blocks, block_size, max_num_seqs,
                             max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill,
                             kv_cache_dtype=kv_cache_dtype, proposer=proposer,
                             num_speculative_tokens=num_speculative_tokens or 0)

    def _blocks_for_memory(self, block_size: int, memory_bytes: Optional[int], utilization: float,
                           step_tokens: int) -> int:
        """How many KV blocks fit the budget. On CUDA: run one full-size step first, then give the
        cache what is left of utilization x device memory after the weights, that step's peak
        activations and whatever else holds device memory."""
        per_block = KVPool.bytes_per_block(self.config, block_size, self.dtype, self.kv_cache_dtype)
        if memory_bytes is None and self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            tokens = torch.zeros(1, step_tokens, dtype=torch.long, device=self.device)
            self.model(tokens, torch.arange(step_tokens, device=self.device)[None])
            free, total = torch.cuda.mem_get_info(self.device)
            elsewhere = total - free - torch.cuda.memory_reserved(self.device)  # other processes, CUDA context
            memory_bytes = int(total * utilization) - torch.cuda.max_memory_allocated(self.device) - elsewhere
        elif memory_bytes is None:
            memory_bytes = 2**30
        if memory_bytes < per_block:
            raise ValueError(f"the KV cache budget ({memory_bytes} bytes) is smaller than one block ({per_block} bytes): "
                             "raise gpu_memory_utilization or kv_cache_memory_bytes")
        return memory_bytes // per_block

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self):
        return self.tokenizer

    def set_attention(self, attention: Union[str, AttentionFn]) -> None:
        """Swap the attention backend (a name or a function with the documented contract)."""
        self.model.attention_fn = get_attention_fn(attention)

    def generate(self, prompts: Union[PromptType, list[PromptType]],
                 sampling_params: Union[SamplingParams, list[SamplingParams], None] = None,
                 use_tqdm: bool = True, use_cache: bool = True, batching: str = "continuous") -> list[RequestOutput]:
        """Generate completions for one prompt or a list (strings or {"prompt_token_ids": [...]}).

        batching: "continuous" (the serving engine) or "static" (the simple loop of chapters 00-02:
        fixed batches of max_num_seqs, each decoded until its longest member ends). use_cache=False
        recomputes everything every step (static loop only; for the KV-cache lesson).
        """
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {batching!r}")
        if (batching == "static" or not use_cache) and self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} lives in the paged engine: use "
                             "batching='continuous' with use_cache=True, or an LLM with kv_cache_dtype='auto'")
        if (batching == "static" or not use_cache) and self.engine.proposer is not None:
            raise ValueError("speculative decoding runs in the serving engine: use batching='continuous' with "
                             "use_cache=True, or an LLM without speculative_model")
        requests = self._make_requests(prompts, sampling_params)
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm or len(requests) < 2)
        if batching == "static" or not use_cache:
            sequences = [seq for request in requests for seq in request.seqs]
            for start in range(0, len(sequences), self.max_num_seqs):
                batch = sequences[start:start + self.max_num_seqs]
                for _ in generate_static_batch(self.model, self.tokenizer, batch, self.eos_token_ids, use_cache):
                    pass
                bar.update(sum(any(r.seqs[-1] is s for s in batch) for r in requests))
        else:
            try:
                for request in requests:
                    self.engine.add_request(request)
                while self.engine.has_unfinished_requests():
                    bar.update(sum(out.finished for out in self.engine.step()))
            except BaseException:  # a rejected request, Ctrl-C...: leave the engine clean for the next call
                for request in requests:
                    self.engine.abort_request(request.request_id)
                raise
        bar.close()
        return [r.to_output() for r in requests]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, list[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not conversations:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every new token (cumulative text, as vLLM streams it)."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream() generates one completion: n must be 1, got {params.n}")
        request_id = self.add_request(prompt, params)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id == request_id:
                        yield output
        finally:  # the caller may stop reading early: free the request's blocks
            self.engine.abort_request(request_id)

    # ------------------------------------------------------------------ the engine, one step at a time
    def add_request(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> str:
        """Queue one request in the serving engine (checked first); returns its request id."""
        (request,) = self._make_requests(prompt, sampling_params)
        self.engine.add_request(request)
        return request.request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests that got a token in it."""
        return self.engine.step()

    def abort_request(self, request_id: str) -> None:
        """Drop a request at any point; its KV blocks go back to the pool."""
        self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> str:
        for m in conversation:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"each message must be {{'role': str, 'content': str}}, got {m!r}")
        return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)

    # ------------------------------------------------------------------ internals
    def _tokenize(self, prompt: PromptType, index: int) -> tuple[Optional[str], list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty: give at least one character")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if not ids or not all(isinstance(t, int) and 0 <= t < self.config.vocab_size for t in ids):
                raise ValueError(f"prompt {index}: prompt_token_ids must be a non-empty list of ints in [0, {self.config.vocab_size})")
        else:
            raise ValueError(f"prompt {index} must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; the context window is {self.max_model_len} "
                             "and at least one must be left to generate")
        return text, ids

    def _make_requests(self, prompts, sampling_params) -> list[Request]:
        """Check every prompt and parameter first, so one bad request fails before any work starts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a {'prompt_token_ids': [...]} dict, or a non-empty list of them")
        params_list = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts: give one, or one per prompt")
        params_list = [p if p is not None else SamplingParams() for p in params_list]
        for i, p in enumerate(params_list):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params {i} must be a SamplingParams, got {type(p).__name__}")
        tokenized = [self._tokenize(p, i) for i, p in enumerate(prompts)]
        requests = []
        for (text, ids), params in zip(tokenized, params_list):
            self._request_counter += 1
            arrival = time.perf_counter()
            room = self.max_model_len - len(ids)
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
            base_seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_stream))
            seqs = [Sequence(ids, params, max_tokens, torch.Generator().manual_seed(_sequence_seed(base_seed, index)),
                             RequestMetrics(arrival, num_prompt_tokens=len(ids)), index) for index in range(params.n)]
            request = Request(str(self._request_counter - 1), text, ids, seqs)
            requests.append(request)
        return requests


def _sequence_seed(seed: int, index: int) -> int:
    """Completion 0 uses the seed itself; completions 1..n-1 get independent streams derived from it."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little")
