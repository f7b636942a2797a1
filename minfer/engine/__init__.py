"""The serving engine: many requests, one scheduled step at a time.

Where a request goes, file by file:

    engine.py           Engine.add_request queues it; Engine.step = schedule -> run -> postprocess
    scheduler.py          schedule: which sequences run this step and how many tokens each brings
    block_manager.py      ... and which KV blocks hold them (shared prefixes found by hash)
    model_runner.py     run: the step's tensors, the forward pass, batched sampling
    block_tables.py       the running sequences' block tables, rows of one tensor written where they changed
    paged_kv.py           during the forward pass: storing K/V in the pool and attending over it
    cuda_graphs.py        the default on CUDA: decode steps replayed as CUDA graphs
    compiled_decode.py    enforce_eager=False elsewhere: the decode step through torch.compile
    structured_output.py  before sampling: the tokens a requested shape (JSON schema, regex, ...) forbids, masked
    engine.py           postprocess: append tokens (or accept drafts), finish, free blocks, outputs
    overlap.py          async_scheduling=True: step n + 1 launched before step n's tokens are read

Beside the step:

    build.py            which features combine (`plan`, every refusal in one table) and building a rank's model
    buckets.py          the token counts a step is padded up to, so the matmuls meet a bounded set of shapes
    kv_calibration.py   an fp8 KV pool's static scales: one pass over the calibration text, |k| and |v| recorded
    parallel.py         tensor parallelism: rank 0 runs the engine, workers run their shard of every layer
    tp_worker.py        ... the calls rank 0 sends them (a method name, dataclass arguments) and the worker's side
    snapshot.py         the engine's state at one moment, frozen: what servers, notebooks and benchmarks read

Speculative decoding, which the engine runs when asked, is its own package: `minfer/speculative/`.
"""
