"""Loading: Hugging Face directories (Llama, Qwen2), GGUF details, and clear errors on bad files."""
import json

import pytest
import torch

from minfer import LLM
from minfer.models.loader import load_model, resolve_model_path, unpermute_qk
from minfer.testing import tiny_hf_checkpoint


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_hf_directory_matches_transformers(tmp_path, llm, model_type, tie):
    reference = tiny_hf_checkpoint(tmp_path, llm.tokenizer, model_type, tie)
    tiny = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert tiny.config.architecture == model_type and tiny.config.attention_bias == (model_type == "qwen2")
    ids = torch.tensor([[1, 400, 2000, 31, 9000, 77, 5]])
    ours = tiny.model(ids, torch.arange(ids.shape[1])[None], last_only=False)
    with torch.no_grad():
        theirs = reference(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter: reshape(heads, 2, d/2, ...) -> swap -> reshape; unpermute must undo it
    w = torch.randn(3 * 8, 5).numpy()
    permuted = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    assert (unpermute_qk(permuted, 3) == w).all()


def test_default_model_shape(llm):
    c = llm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 1e5
    assert llm.model.lm_head.weight is llm.model.embed_tokens.weight


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*smollm2-135m"):
        resolve_model_path("no-such-model")


def test_corrupt_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(str(bad))


def test_truncated_safetensors(tmp_path, llm):
    tiny_hf_checkpoint(tmp_path, llm.tokenizer, "llama", True)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_model(str(tmp_path))


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json and \\*.safetensors"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path, llm):
    tiny_hf_checkpoint(tmp_path, llm.tokenizer, "llama", True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'.*llama, qwen2"):
        load_model(str(tmp_path))


def test_not_a_model_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="neither a .gguf file nor"):
        load_model(str(text))
