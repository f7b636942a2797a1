"""Loading: Hugging Face directories (Llama, Qwen2), GGUF details, and clear errors on bad files."""
import json

import pytest
import torch

from minfer import LLM
from minfer.models import loader
from minfer.models.loader import gguf_tokenizer, load_model, resolve_model_path, tokenizer_cache_dir, unpermute_qk
from minfer.lab.testing import tiny_hf_checkpoint


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


def test_the_hugging_face_id_names_the_packaged_model():
    # vLLM's LLM takes the Hugging Face id: the same script runs on both, minfer from the packaged file
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == resolve_model_path("smollm2-135m")
    with pytest.raises(ValueError, match="unknown model 'HuggingFaceTB/SmolLM2-360M-Instruct'"):
        resolve_model_path("HuggingFaceTB/SmolLM2-360M-Instruct")  # a sibling that is not installed


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*smollm2-135m"):
        resolve_model_path("no-such-model")


def test_corrupt_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="GGUF version 0"):
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


@pytest.mark.parametrize("change, message", [
    (lambda c: [1, 2], "is not a valid model config"),
    (lambda c: {**c, "num_key_value_heads": 0}, "num_kv_heads must be an integer >= 1, got 0"),
    (lambda c: {**c, "num_attention_heads": "4"}, "is not a valid model config|num_heads must be an integer"),
    (lambda c: {**c, "num_hidden_layers": -1}, "num_layers must be an integer >= 1, got -1"),
    (lambda c: {**c, "rope_theta": "abc"}, "could not convert string to float"),
])
def test_a_malformed_config_is_refused_naming_the_file(tmp_path, llm, change, message):
    tiny_hf_checkpoint(tmp_path, llm.tokenizer, "llama", True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(change(config)))
    with pytest.raises(ValueError, match=message) as error:
        load_model(str(tmp_path))
    assert "config.json" in str(error.value)


def test_not_a_model_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="neither a .gguf file nor"):
        load_model(str(text))


def test_gguf_tokenizer_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """The cached tokenizer encodes, decodes and templates like the one transformers converts from the
    file; the second load converts nothing; a damaged entry is rebuilt; no writable cache still works."""
    from transformers import AutoTokenizer

    conversions = []
    real = AutoTokenizer.from_pretrained

    def counting(*args, **kwargs):
        conversions.extend([kwargs["gguf_file"]] if "gguf_file" in kwargs else [])
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counting)
    monkeypatch.setenv("MINFER_CACHE", str(tmp_path / "cache"))
    path = resolve_model_path("smollm2-135m")
    converted = gguf_tokenizer(path)
    assert len(conversions) == 1 and len(list(tokenizer_cache_dir().iterdir())) == 1
    cached = gguf_tokenizer(path)
    assert len(conversions) == 1  # read back, not converted again
    texts = ["The capital of France is", "def add(a, b):\n    return a + b  # ünïcode, 東京, 🙂",
             "<|im_start|>user\nHi<|im_end|>"]
    for text in texts:
        assert cached.encode(text) == converted.encode(text)
        assert cached.decode(cached.encode(text)) == converted.decode(converted.encode(text))
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert (cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == converted.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (cached.eos_token_id, cached.bos_token_id, len(cached)) == (converted.eos_token_id, converted.bos_token_id,
                                                                      len(converted))
    assert loader.load_tokenizer("smollm2-135m").encode(texts[0]) == converted.encode(texts[0])
    assert len(conversions) == 1  # the short name finds the same entry
    entry = next(tokenizer_cache_dir().iterdir())
    (entry / "tokenizer.json").write_text("{ damaged")
    assert gguf_tokenizer(path).encode(texts[1]) == converted.encode(texts[1])
    assert len(conversions) == 2  # rebuilt
    assert cached.encode(texts[1]) == AutoTokenizer.from_pretrained(entry).encode(texts[1])  # and saved again
    monkeypatch.setenv("MINFER_CACHE", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a folder")
    assert gguf_tokenizer(path).encode(texts[0]) == converted.encode(texts[0])


def test_building_a_model_from_weights_imports_no_compiler():
    """`LlamaModel.empty` (and a draft's) build on the meta device, where an op that only Python implements
    (nn.Embedding's random init, say) imports torch._dynamo: most of a second of every process's first model."""
    import subprocess
    import sys

    code = ("import dataclasses, sys, torch\n"
            "from minfer.models.llama import LlamaModel\n"
            "from minfer.speculative.pruned_draft import empty_draft\n"
            "from minfer.lab.testing import tiny_llama\n"
            "config = tiny_llama().config\n"
            "model = LlamaModel.empty(config)\n"
            "draft = empty_draft(dataclasses.replace(config, tie_word_embeddings=False), 16)\n"
            "assert model.rope.cos.shape == (config.max_position_embeddings, config.head_dim)\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"torch._dynamo was imported: {done.stdout.strip()}"
