"""minfer: a compact LLM inference engine, built chapter by chapter in the course.

Imports run one way, bottom to top: a module imports its own layer and the layers below it,
never one above, and nothing imports in a circle (tests/test_import_layers.py holds the table).

    formats/           number formats: int8, int4, NF4, fp8 KV entries, a GGUF file's tables
    kernels/           Triton kernels beside the PyTorch they must equal (they import only formats/)
    config.py          the shape of a model (ModelConfig) and every engine argument (EngineConfig), checked
    texts.py           the fixed evaluation and calibration texts (slices of pydoc_data)
    sampling_params.py SamplingParams: how to pick each next token and when to stop
    logprobs.py        log-probabilities as vLLM returns them
    outputs.py         what generate() returns: RequestOutput, CompletionOutput, timing metrics
    detokenizer.py     the text of a growing sequence of tokens, a few tokens per step
    sequence.py        one completion being generated: prompt, settings, tokens so far, when to stop
    host_copy.py       host data onto the device without waiting for it (pinned, queued copies)
    layers/            the pieces the model is built from and the engine calls
    kv_cache.py        a contiguous KV cache (chapter 02), one of the caches attention writes to
    models/            the decoder and its loading
    quant/             quantization applied to a loaded model; moe/carve.py, experts carved from it
    engine/            the serving engine, one scheduled step at a time; speculative/, speculative decoding
    metrics.py         the engine's gauges and counters as vLLM's get_metrics() records
    generate.py        the simple loop of chapters 00-02: static batches over a contiguous KV cache
    llm.py             LLM, the entry point
    serving/           the OpenAI-compatible HTTP server around an LLM
    __init__.py        the public names: LLM, SamplingParams, RequestOutput, ...

Course code sits on top, in its own package, and may use all of it; the library never imports it:

    lab/               benchmark harnesses, evaluation, the course machinery, the router study, test models,
                       and the training code of chapters 06b, 08 and 10 (see minfer/lab/__init__.py)
    __main__.py        the `minfer` command line
"""
from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]


def __getattr__(name: str):
    # LLM brings the whole engine, Triton included: imported when first used, so that `import minfer.lab.course`
    # stays light and a notebook can still choose Triton's interpreter before Triton is imported.
    if name == "LLM":
        from minfer.llm import LLM

        return LLM
    raise AttributeError(f"module 'minfer' has no attribute {name!r}")
