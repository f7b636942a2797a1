"""Chapter 04: static vs continuous batching, and the scheduler's admission step.

Fill in each function (replace `raise NotImplementedError`), then run `check("ch04")` in the
notebook.
"""
from __future__ import annotations


def slot_timeline(output_lengths: list[int], num_slots: int, continuous: bool) -> list[list[int]]:
    """Who occupies which batch slot at every decode step, under static or continuous batching.

    Request i needs output_lengths[i] >= 1 steps (one token per step) and requests are served in
    index order. Returns one row per step, each a list of num_slots entries: the request index
    in that slot, or -1 for an idle slot. The last row is the step in which the last request
    finishes.

    Static: requests go in batches of num_slots (request i in slot i % num_slots); a batch runs
    until its longest member is done, finished members leave their slot idle; the next batch
    starts in the following step.
    Continuous: a request that finishes in step t frees its slot, and in step t + 1 the next
    waiting request takes the lowest-numbered free slot. At step 0 the first num_slots requests
    fill slots 0, 1, ... in order.
    """
    raise NotImplementedError("write me")


def admit(waiting: list[int], num_running: int, free_blocks: int, budget: int, max_num_seqs: int,
          block_size: int, chunked_prefill: bool = True) -> list[int]:
    """The admission step of the scheduler: which waiting requests start in this step, and how much.

    waiting: the prompt lengths of the waiting requests, oldest first. num_running: sequences
    already running; free_blocks: KV blocks still free; budget: tokens left in this step after
    the running sequences took theirs. Returns the number of prompt tokens each admitted request
    computes this step, for waiting[0], waiting[1], ... in order (so len(result) requests start).

    Rules, the engine's (minfer/engine/scheduler.py, without prefix caching):
    * first come, first served: stop at the first request that cannot start, never skip it;
    * at most max_num_seqs sequences run (num_running included), and nothing starts once the
      budget is spent;
    * a request needs blocks for its whole prompt (ceil(length / block_size)) at admission;
    * with chunked_prefill a request may start with only part of its prompt (as much as the
      budget allows); without it, a prompt larger than the remaining budget waits.
    """
    raise NotImplementedError("write me")
