"""The model against transformers on the same weights: logits and greedy tokens."""
import os

import pytest
import torch

from minfer import SamplingParams
from minfer.layers.linear import PackedLinear
from minfer.models.llama import LlamaModel
from minfer.models.loader import load_model, resolve_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\n\n# compute the mean of a list",
]


@pytest.mark.slow
def test_logits_match_transformers(llm, hf_reference_model):
    """The model as written (plain nn.Linear layers) within 1e-4; the LLM's CPU-packed matmuls
    (minfer.layers.linear) sum in another order, within 1e-3."""
    loaded = load_model("smollm2-135m", torch.float32)
    plain = LlamaModel.from_weights(loaded.config, loaded.weights)
    assert any(isinstance(m, PackedLinear) for m in llm.model.modules())
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        input_ids = torch.tensor([ids])
        positions = torch.arange(len(ids))[None]
        ours, packed = plain(input_ids, positions, last_only=False), llm.model(input_ids, positions, last_only=False)
        with torch.no_grad():
            theirs = hf_reference_model(input_ids).logits
        assert ours.shape == theirs.shape == packed.shape
        assert (ours - theirs).abs().max().item() <= 1e-4, prompt
        assert (packed - theirs).abs().max().item() <= 1e-3, prompt


@pytest.mark.slow
def test_greedy_tokens_match_transformers_generate(llm, hf_reference_model):
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        input_ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            reference = hf_reference_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                                    max_new_tokens=64, do_sample=False)
        assert out.outputs[0].token_ids == reference[0, input_ids.shape[1]:].tolist(), prompt
    assert sum(len(o.outputs[0].token_ids) == 64 for o in outputs) >= 5


@pytest.mark.slow
def test_gguf_loader_matches_transformers_gguf_reader():
    """Our dequantize + un-permute of q/k equals what transformers makes of the same GGUF file."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("smollm2-135m")
    folder, filename = os.path.split(path)
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32).state_dict()
    ours = load_model("smollm2-135m").weights
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"]:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_attention_backends_give_the_same_text(llm, backend):
    params = SamplingParams(temperature=0, max_tokens=12)
    baseline = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    llm.set_attention(backend)
    try:
        result = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    finally:
        llm.set_attention("sdpa")
    assert [r.outputs[0].token_ids for r in result] == [b.outputs[0].token_ids for b in baseline]
