"""The course's lab: everything that measures, teaches or trains, apart from the engine that serves.

The library (everything in minfer/ outside this package and __main__.py) never imports it
(tests/test_import_layers.py); the notebooks, exercises, tests and benchmarks/ scripts do.

    bench/          benchmark harnesses: `python -m minfer bench`, benchmarks/ and the notebooks' measurements
    evaluate.py     perplexity and greedy agreement on the fixed evaluation text, through the public API
    course.py       a chapter's code: the learner's (exercises/) or the worked solutions, loaded and checked
    glass.py        a notebook's window on a running engine: its KV pool, queues and last step
    router.py       a router study: easy requests to a cheap model, hard ones to the full model (chapter 08)
    router_tasks.py the router's labelled, checkable tasks, made in code
    testing.py      small models with random weights, for tests and benchmarks without the model file
    host_sync.py    what would make the host wait for a GPU (reads back, pageable copies), caught on a CPU
    distill.py      how the shipped draft was trained: distillation loss, teacher top-k, the training loop (chapter 08)
    qat.py          quantization-aware fine-tuning: float weights trained against their int4 rounding (chapter 06b)
    tiny_moe.py     a tiny byte-level language model trained dense and as a Switch MoE, per FLOP (chapter 10)
"""
