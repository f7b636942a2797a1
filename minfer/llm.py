"""`LLM`: the public entry point, a compatible subset of vLLM's `vllm.LLM`.

    from minfer import LLM, SamplingParams          # later: from vllm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20))
    print(outputs[0].outputs[0].text)
"""
from __future__ import annotations

import hashlib
import time
from typing import Iterable, Iterator, Optional, Union

import torch
from tqdm.auto import tqdm

from minfer.generate import Sequence, generate_static_batch
from minfer.layers.attention import AttentionFn, get_attention_fn
from minfer.models.llama import LlamaModel
from minfer.models.loader import DEFAULT_MODEL, load_model
from minfer.outputs import RequestMetrics, RequestOutput
from minfer.sampling_params import SamplingParams

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
    max_model_len: the context window (default: the model's). max_num_seqs: how many sequences
    one batch holds. seed: seeds requests that bring no seed of their own. attention: 'sdpa',
    'reference' or your own function (see `minfer.layers.attention`).
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: Union[str, torch.dtype] = "auto", device: str = "auto",
                 max_model_len: Optional[int] = None, max_num_seqs: int = 32, seed: int = 0,
                 attention: Union[str, AttentionFn] = "sdpa") -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        loaded = load_model(model, self.dtype)
        self.config, self.tokenizer, self.model_path = loaded.config, loaded.tokenizer, loaded.path
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not (isinstance(max_model_len, int) and 1 <= max_model_len <= limit):
            raise ValueError(f"max_model_len must be an integer in [1, {limit}] for this model, got {max_model_len!r}")
        self.max_model_len = max_model_len or limit
        self.max_num_seqs = max_num_seqs
        self.model = LlamaModel.from_weights(self.config, loaded.weights, self.dtype, self.device)
        self.model.eval()
        self.set_attention(attention)
        self.eos_token_ids = {t for t in (self.tokenizer.eos_token_id,) if t is not None}
        self._seed_stream = torch.Generator().manual_seed(seed)
        self._request_counter = 0

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self):
        return self.tokenizer

    def set_attention(self, attention: Union[str, AttentionFn]) -> None:
        """Swap the attention backend (a name or a function with the documented contract)."""
        self.model.attention_fn = get_attention_fn(attention)

    def generate(self, prompts: Union[PromptType, list[PromptType]],
                 sampling_params: Union[SamplingParams, list[SamplingParams], None] = None,
                 use_tqdm: bool = True, use_cache: bool = True) -> list[RequestOutput]:
        """Generate completions for one prompt or a list (strings or {"prompt_token_ids": [...]})."""
        requests = self._make_requests(prompts, sampling_params)
        sequences = [seq for request in requests for seq in request["seqs"]]
        bar = tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm or len(requests) < 2)
        for batch in self._batches(sequences):
            for _ in generate_static_batch(self.model, self.tokenizer, batch, self.eos_token_ids, use_cache):
                pass
            bar.update(sum(r["seqs"][-1] in batch for r in requests))
        bar.close()
        return [self._request_output(r) for r in requests]

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
        (request,) = self._make_requests(prompt, params)
        for _ in generate_static_batch(self.model, self.tokenizer, request["seqs"], self.eos_token_ids):
            yield self._request_output(request)

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

    def _make_requests(self, prompts, sampling_params) -> list[dict]:
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
            request = {"id": str(self._request_counter - 1), "prompt": text, "ids": ids, "seqs": []}
            for index in range(params.n):
                seq = Sequence(ids, params, max_tokens, torch.Generator().manual_seed(_sequence_seed(base_seed, index)),
                               RequestMetrics(arrival, num_prompt_tokens=len(ids)), index)
                request["seqs"].append(seq)
            requests.append(request)
        return requests

    def _batches(self, seqs: list[Sequence]) -> Iterable[list[Sequence]]:
        for start in range(0, len(seqs), self.max_num_seqs):
            yield seqs[start:start + self.max_num_seqs]

    @staticmethod
    def _request_output(request: dict) -> RequestOutput:
        seqs = request["seqs"]
        finished = all(s.finished for s in seqs)
        return RequestOutput(request["id"], request["prompt"], request["ids"], [s.to_output() for s in seqs],
                             finished, seqs[0].metrics)


def _sequence_seed(seed: int, index: int) -> int:
    """Completion 0 uses the seed itself; completions 1..n-1 get independent streams derived from it."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest()[:8], "little")
