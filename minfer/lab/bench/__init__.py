"""Benchmark harnesses: how minfer is measured, for the scripts in `benchmarks/`, `python -m minfer bench`
and the notebooks (a notebook's measurement and the published one share the same function).

    common.py    what every harness shares: synchronize and best_time (the one "fastest of a few
                 runs"), the transformers step clock, machine info, loading transformers on the
                 same weights, quiet(), and writing a benchmark's section of a docs page
    timing.py    one decode measurement (Timing: TTFT, TPOT, decode tokens/s, MBU) and the best of repeats
    decode_speed.py  decode speed against its memory bound: minfer timed on token-id prompts, memory
                 bandwidth, weight bytes per step, the matmul floor, MBU (chapter 00; quant.py and
                 kernels.py measure with it too)
    transformers_timing.py  transformers' `generate` timed as minfer is (step clock, EOS off, left padding)
    generate.py  the generate benchmark: minfer vs transformers `generate` vs the bare-matmul floor, its
                 presets, the run and its command line (bench_generate.py, `python -m minfer bench`)
    generate_report.py  its report: the ratios, the markdown table against the targets, the docs section
    serving.py   many requests at once: continuous vs static batching vs one by one vs transformers,
                 KV memory waste, prefix caching, run as one benchmark (chapters 03-05, bench_serving.py)
    serving_workload.py  its workload (prompts cut from the Python docs, spread output lengths) and the
                 KV memory each cache layout reserves for it
    serving_stats.py  a run's results as one row: throughput, TTFT/TPOT percentiles, the load average
    serving_engines.py  the workload run through minfer continuous, static, one by one, and transformers
    serving_prefix.py  the prefix-caching experiment: shared text first or after, passages stable or shuffled
    serving_report.py  its report: the markdown tables against the targets, the docs section, the plot
    quant.py     each quantization format's perplexity, greedy agreement, bytes and decode speed, the
                 channel-scrambled model, llama.cpp beside (chapter 06, bench_quant.py)
    real_size.py the weight formats' decode speed on random weights of Llama-3.1-8B's shapes, built on the
                 device (chapter 06's GPU cell)
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
    moe.py       mixture of experts: the distinct experts a batch touches, routing simulated, the carved and
                 tiny trained MoEs measured (chapter 10, bench_moe.py)
    host.py      the host's work per decode step and how it grows with the batch (chapter 12,
                 `python -m minfer bench host`)
    serve.py     `python -m minfer bench serve`: load-test OpenAI-compatible servers over HTTP (chapter 09)
    loadgen.py     its client side: when requests arrive, what they ask for, how each is timed
    latency.py     the latency statistics of a run and of a sweep over request rates (vLLM's field names)
    launch.py      the servers a benchmark starts itself: a free port, waiting until it answers, a graceful stop
    serve_report.py  its report: a markdown table per run, the sustainable rates, the plot, JSON
    soak.py      the soak: thousands of mixed requests through the engine, memory sampled as they go
    hostile.py     the hostile soak: ordinary clients beside hostile ones, through the HTTP server
    notebook_cells.py  which cells of a notebook a given cell needs (the names each defines and reads)

The rule: the library never imports minfer.lab.bench. Harnesses use the library, never the reverse;
only the command line (`minfer/__main__.py`) reaches in, for `python -m minfer bench`. No harness
derives a path from its own location: the docs page to update is passed in.
"""
