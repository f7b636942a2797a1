"""Models and their loading:

    llama.py    the Llama-family decoder (Llama, SmolLM2, Qwen2), readable top to bottom
    moe.py      the sparse MLP block of Mixtral, Qwen2-MoE and Qwen3-MoE, and their checkpoints' expert names
    loader.py   GGUF files and Hugging Face folders -> a ModelConfig, weights and a tokenizer
    quantization_config.py  a saved quantized checkpoint's `quantization_config`: what the loader checks
"""
