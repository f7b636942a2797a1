"""Tensor parallelism: `LLM(model, tensor_parallel_size=N)` runs every layer split over N processes.

    llm = LLM("smollm2-135m", tensor_parallel_size=3)     # 9 query heads, 3 KV heads: N is 1 or 3
    llm.generate(prompts, params)                          # as before; the split is invisible here
    llm.engine.snapshot().communication                    # all-reduces: count, bytes, seconds (rank 0's view)

Who does what (the layout of vLLM's and nano-vllm's engines):

* **Rank 0** is the process that made the `LLM`. It runs everything that decides: the scheduler,
  the block manager (so continuous batching, preemption and prefix caching work unchanged) and
  sampling. Each step it prepares the step's tensors as usual, then broadcasts them (token ids,
  positions, each sequence's slice and block table) to the workers (`ParallelModelRunner`), as a
  call of a worker method by name (`minfer.engine.tp_worker`).
* **Ranks 1..N-1** are worker processes started here with torch.multiprocessing (spawn; fork for a
  script without `if __name__ == "__main__":`, see `start_method`). Each
  holds 1/N of every layer (`minfer.layers.parallel_linear`) and a KV pool of its own for its KV
  heads, with the same block numbering as rank 0's: a block table means the same on every rank.
  A worker waits for a step, runs the same forward pass on its shard, and waits again.
* Every rank joins the two all-reduces per layer (after o_proj and down_proj); torch.distributed
  carries them: gloo between CPU processes, NCCL between GPUs.

The embedding and the output head are replicated, not split by vocabulary. Split, the embedding
would need one more all-reduce per step and the head an all-gather of logits (vocabulary x tokens);
replicated, they cost memory on every device (SmolLM2-135M: 49152 x 576, tied, 28 M parameters,
113 MB in float32) and no communication. Only rank 0 runs the head, since only rank 0 samples.
For a small model that is the better trade; for a 70B model (128256 x 8192 twice, 4.2 GB in
bfloat16) vocabulary-parallel is what vLLM does.

Not supported with N > 1 (each refused with a ValueError by `minfer.engine.build.plan`): speculative decoding, the calibrated
quantizations 'awq' and 'gptq' (calibration runs the whole model) and saved quantized checkpoints,
compiled decode (enforce_eager=False), attention functions other than a backend's name, mixture of
experts. 'int8', 'int4' and 'nf4' quantize each shard after slicing (the group size must divide a
shard's inputs). One tensor-parallel LLM per process at a time (torch.distributed has one default
group); workers stop when it is garbage-collected, at exit, or if rank 0 dies.
"""
from __future__ import annotations

import ast
import os
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minfer.config import EngineConfig
from minfer.engine.build import BuildPlan, build_model, rank_checkpoint, rank_device
from minfer.engine.model_runner import ModelRunner, PreparedStep, profiles_memory
from minfer.engine.tp_worker import Call, Channel, PoolSpec, ProfileSize, StepInputs, Worker, broadcast_payload
from minfer.layers.parallel_linear import CommStats
from minfer.models.llama import LlamaModel
from minfer.models.loader import LoadedModel
from minfer.sequence import Sequence

TIMEOUT = timedelta(minutes=5)  # a collective that waits this long means a rank died


class TensorParallelWorkers:
    """Rank 0's side: starts ranks 1..N-1, builds its own shard, sends each step, stops them."""

    def __init__(self, build: BuildPlan, loaded: LoadedModel) -> None:
        n = build.tensor_parallel_size
        self.device = rank_device(build, 0)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.start_method = start_method(n)  # "spawn", or "fork" for a script without the __main__ guard
        context = mp.get_context(self.start_method)
        target = forked_worker if self.start_method == "fork" else worker_main
        port = free_port()
        self.processes, ready = [], context.Queue()
        for rank in range(1, n):  # they load while rank 0 builds its own shard
            args = (rank, port, backend, build, rank_checkpoint(build, loaded, rank), os.getpid(),
                    torch.get_num_threads(), ready)
            process = context.Process(target=target, args=args, daemon=True, name=f"minfer-tp-rank{rank}")
            process.start()
            self.processes.append(process)
        self._stopper = weakref.finalize(self, stop_workers, self.processes, self.device)  # at GC and at exit
        self.stats = CommStats()
        self.channel = Channel(self.device, self.stats)
        self.model = build_model(build, rank_checkpoint(build, loaded, 0), 0, self.stats)
        wait_until_ready(self.processes, ready)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=n, timeout=TIMEOUT)

    def call(self, method: str, *args) -> None:
        """Have every worker run its method `method` on args (`minfer.engine.tp_worker.Worker`)."""
        self.channel.call(method, *args)

    def shutdown(self) -> None:
        """Stop the workers now (also done when this object is collected, and at exit)."""
        self._stopper()


def start_method(n: int) -> str:
    """How the workers start: "spawn" (a fresh interpreter: no threads or CUDA state inherited), or "fork".

    Spawn makes each worker import the main script again. A script that builds the LLM at its top level,
    not under `if __name__ == "__main__":`, would build it again in every worker, which would start workers
    of its own. Such a script gets fork, a copy of this process that runs nothing again, where fork is safe
    (as vLLM does): on POSIX, and before CUDA is initialised (a forked child cannot use its parent's CUDA
    context). Elsewhere it gets an error that names the fix, before any worker starts.
    """
    if not called_from_unguarded_script():
        return "spawn"
    if "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized():
        return "fork"
    why = "CUDA is initialised in this process" if torch.cuda.is_initialized() else "this platform cannot fork"
    raise RuntimeError(f"tensor_parallel_size={n} starts its workers with spawn ({why}, so fork is not safe), "
                       "which runs the main script again in each worker: create the LLM under "
                       "`if __name__ == \"__main__\":` (at the end of the script, or call a main() from there)")


def called_from_unguarded_script() -> bool:
    """Whether spawn would run this call again: it runs at the top level of the main script (itself, or through
    the functions it calls), outside `if __name__ == "__main__":`. Interactive sessions and notebooks (a main
    module without a file) and `python -m package` (its __main__.py) are never run again by spawn."""
    main = sys.modules["__main__"]
    path, name = getattr(main, "__file__", None), getattr(getattr(main, "__spec__", None), "name", None) or ""
    if path is None or name.endswith("__main__"):
        return False
    lines = [line for frame, line in traceback.walk_stack(sys._getframe())
             if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>"]
    if not lines:  # called from elsewhere: a thread, an atexit handler
        return False
    line = lines[-1]  # the outermost: the script's own top level (not an exec() inside it)
    try:
        with open(path, "rb") as f:  # an absolute path since Python 3.9
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return True  # no file to read (code from stdin, '<stdin>'): spawn could not run it either
    return not any(is_main_guard(node) and node.body[0].lineno <= line <= node.body[-1].end_lineno
                   for node in tree.body)


def is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":`, either way round."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return False
    a, b = node.test.left, node.test.comparators[0]
    return (_is_name(a) and _is_main(b)) or (_is_main(a) and _is_name(b))


def _is_name(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "__name__"


def _is_main(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == "__main__"


def wait_until_ready(processes: list, ready) -> None:
    """Wait for every worker's shard, however long a busy machine takes, but not for a worker that died."""
    pending = {p.name for p in processes}
    while pending:
        try:
            pending.discard(ready.get(timeout=1.0))
        except queue.Empty:
            for p in processes:
                if p.name in pending and not p.is_alive():
                    raise RuntimeError(f"tensor-parallel worker {p.name} exited with code {p.exitcode} while starting")


def stop_workers(processes: list, device: torch.device) -> None:
    if dist.is_initialized():
        try:
            broadcast_payload(pickle.dumps(Call("stop")), device)
        except Exception:  # a worker died already: the join below ends the rest
            pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()
    if dist.is_initialized():
        dist.destroy_process_group()


class ParallelModelRunner(ModelRunner):
    """The model runner of rank 0: the same steps, each one also sent to the workers before it runs."""

    graphs_allowed = False  # the workers run every step eagerly, and rank 0 with them

    def __init__(self, model: LlamaModel, config: EngineConfig, workers: TensorParallelWorkers) -> None:
        if profiles_memory(config, model.embed_tokens.weight.device):  # its all-reduces need every rank
            workers.call("profile", ProfileSize(config.max_num_batched_tokens, config.max_model_len))
        super().__init__(model, config)
        self.workers, self.comm_stats = workers, workers.stats
        workers.call("make_pool", PoolSpec(self.pool.num_blocks, config.block_size, config.kv_cache_dtype,
                                           config.bucket_step_shapes))

    def prepare(self, batch: list[tuple[Sequence, int]], hidden_layers: Optional[tuple[int, ...]] = None) -> PreparedStep:
        step = super().prepare(batch, hidden_layers)
        paged = step.paged
        self.workers.call("step", StepInputs(step.input_ids[0].tolist(), step.positions[0].tolist(), paged.num_tokens,
                                             paged.slices, paged.use_kernels))
        return step


def worker_main(rank: int, port: int, backend: str, build: BuildPlan, checkpoint: LoadedModel, parent_pid: int,
                num_threads: int, ready) -> None:
    """Ranks 1..N-1: build the shard, then run every call rank 0 sends until it calls "stop"."""
    torch.set_num_threads(num_threads)  # as many as rank 0 uses
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    device = rank_device(build, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(build, checkpoint, rank)
    del checkpoint
    ready.put(mp.current_process().name)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=build.tensor_parallel_size, timeout=TIMEOUT)
    Worker(model, build.model_config, build.dtype, device).serve()
    # Leave at once: no destroy_process_group (it would wait on rank 0, which waits for this process to
    # end) and no interpreter teardown (seconds of freeing torch's state on a busy machine).
    os._exit(0)


def forked_worker(*args) -> None:
    """`worker_main` for a forked worker, run in a new thread. GNU OpenMP (PyTorch's threads on Linux) keeps the
    threads of parallel ops in a team per calling thread; fork copies only the calling thread, so the copied team
    would wait forever for threads that the child does not have (its first multi-threaded op hangs once rank 0 has
    run one). A new thread starts a new team."""
    with ThreadPoolExecutor(1) as thread:
        thread.submit(worker_main, *args).result()  # its exception, if any, ends this process with code 1


def _exit_with_parent(parent_pid: int) -> None:
    """No orphans: a worker whose rank 0 died (killed, crashed) exits instead of waiting for it."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now (for the rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
