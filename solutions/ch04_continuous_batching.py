"""Chapter 04, worked: static vs continuous batching, and the scheduler's admission step."""
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
    timeline: list[list[int]] = []
    if not continuous:
        for first in range(0, len(output_lengths), num_slots):
            batch = range(first, min(first + num_slots, len(output_lengths)))
            for step in range(max(output_lengths[i] for i in batch)):
                row = [-1] * num_slots
                for i in batch:
                    if step < output_lengths[i]:
                        row[i - first] = i
                timeline.append(row)
        return timeline
    slots = [-1] * num_slots
    left = [0] * num_slots  # steps still to run for the request in each slot
    next_request = 0
    while True:
        for s in range(num_slots):  # fill free slots, lowest first
            if slots[s] == -1 and next_request < len(output_lengths):
                slots[s], left[s] = next_request, output_lengths[next_request]
                next_request += 1
        if all(r == -1 for r in slots):
            return timeline
        timeline.append(list(slots))
        for s in range(num_slots):
            if slots[s] != -1:
                left[s] -= 1
                if left[s] == 0:
                    slots[s] = -1


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
    chunks: list[int] = []
    for length in waiting:
        if budget <= 0 or num_running + len(chunks) >= max_num_seqs:
            break
        if length > budget and not chunked_prefill:
            break
        blocks = -(-length // block_size)
        if blocks > free_blocks:
            break
        free_blocks -= blocks
        chunk = min(length, budget)
        chunks.append(chunk)
        budget -= chunk
    return chunks
