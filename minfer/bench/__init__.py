"""Benchmark harnesses: how minfer is measured, for the scripts in `benchmarks/`, `python -m minfer bench`
and the notebooks (a notebook's measurement and the published one share the same function).

    common.py    what every harness shares: synchronize and best_time (the one "fastest of a few
                 runs"), the transformers step clock, machine info, loading transformers on the
                 same weights, quiet(), and writing a benchmark's section of a docs page
    generate.py  decode speed: minfer vs transformers `generate` vs the bare-matmul floor, memory
                 bandwidth, weight bytes per step, MBU (chapter 00, bench_generate.py, `python -m minfer bench`)
    serving.py   many requests at once: continuous vs static batching vs one by one vs transformers,
                 KV memory waste, prefix caching (chapters 03-05, bench_serving.py)
    quant.py     each quantization format's perplexity, greedy agreement, bytes and decode speed, the
                 channel-scrambled model, llama.cpp beside (chapter 06, bench_quant.py)
    spec.py      speculative decoding: the expected-speedup formula, a forward pass's cost, the draft
                 cost ratio c, batch-1 decode rate, the prompt sets (chapters 07-08, bench_speculative.py,
                 bench_router.py)
    kernels.py   the paged decode kernel vs its gather reference on CUDA, GB/s and share of peak (chapter 03,
                 bench_kernels.py)
    gpu_figures.py  a chapter's GPU cell: measures on CUDA and stores docs/gpu/<chapter>.json with the device
                 and date; elsewhere shows the stored figures (benchmarks/gpu_check.sh refreshes them)
    router.py    a router measured: the cheap candidates, each studied against the full model on the
                 graded tasks (c, AUC per signal, cost against accuracy, the operating point) (chapter 08,
                 bench_router.py)

The rule: the library never imports minfer.bench. Harnesses use the library, never the reverse;
only the command line (`minfer/__main__.py`) reaches in, for `python -m minfer bench`. No harness
derives a path from its own location: the docs page to update is passed in.
"""
