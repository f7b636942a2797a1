"""Models and their loading:

    llama.py    the Llama-family decoder (Llama, SmolLM2, Qwen2), readable top to bottom
    loader.py   GGUF files and Hugging Face folders -> a ModelConfig, weights and a tokenizer
"""
