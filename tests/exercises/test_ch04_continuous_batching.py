"""Chapter 04: slot timelines against the rules and against the engine's scheduler, and the admission
step against the engine's Scheduler on random situations."""
import pytest
import torch

from minfer import SamplingParams
from minfer.engine.block_manager import BlockManager
from minfer.engine.scheduler import Scheduler
from minfer.outputs import RequestMetrics
from minfer.sequence import Sequence


def make_seq(prompt_len: int, max_tokens: int = 1) -> Sequence:
    return Sequence(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens,
                    0, RequestMetrics(0.0, num_prompt_tokens=prompt_len))


# ----------------------------------------------------------------- timelines

LENGTHS = [5, 1, 2, 8, 3, 1, 4]


def test_static_timeline_by_hand(impl):
    assert impl.slot_timeline([2, 3, 1], 2, continuous=False) == [[0, 1], [0, 1], [-1, 1], [2, -1]]


def test_continuous_timeline_by_hand(impl):
    assert impl.slot_timeline([2, 3, 1, 2], 2, continuous=True) == [[0, 1], [0, 1], [2, 1], [3, -1], [3, -1]]


@pytest.mark.parametrize("continuous", [False, True], ids=["static", "continuous"])
@pytest.mark.parametrize("num_slots", [1, 3, 8])
def test_every_request_runs_its_length_in_one_slot(impl, continuous, num_slots):
    timeline = impl.slot_timeline(LENGTHS, num_slots, continuous)
    assert all(len(row) == num_slots for row in timeline)
    for request, length in enumerate(LENGTHS):
        cells = [(step, slot) for step, row in enumerate(timeline) for slot, r in enumerate(row) if r == request]
        steps = [step for step, _ in cells]
        assert len(cells) == length and len({slot for _, slot in cells}) == 1
        assert steps == list(range(steps[0], steps[0] + length))  # consecutive steps
    assert any(r != -1 for r in timeline[-1])


def test_continuous_never_idles_while_requests_wait_and_beats_static(impl):
    lengths = [30, 1, 1, 1, 25, 2, 2, 2, 20, 1, 3, 1]
    static = impl.slot_timeline(lengths, 4, continuous=False)
    continuous = impl.slot_timeline(lengths, 4, continuous=True)
    for step, row in enumerate(continuous):
        started = {r for earlier in continuous[:step + 1] for r in earlier if r != -1}
        if len(started) < len(lengths):
            assert -1 not in row, f"step {step}: a slot idles while requests wait"
    assert len(continuous) < len(static)
    assert len(static) == 30 + 25 + 20


def test_continuous_timeline_runs_who_the_engine_runs(impl):
    # Drive the real scheduler with 1-token prompts (the first step makes the first token) and
    # plenty of budget and blocks: at every step it runs exactly the requests of the timeline.
    lengths = [4, 1, 6, 2, 2, 5, 1, 3]
    scheduler = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [make_seq(1, n) for n in lengths]
    for seq in seqs:
        scheduler.add(seq)
    engine_steps = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        engine_steps.append(sorted(seqs.index(s) for s, _ in batch))
        for seq, count in batch:
            seq.num_computed += count
            seq.output_ids.append(0)
            if len(seq.output_ids) >= seq.max_tokens:
                scheduler.remove(seq)
    timeline = impl.slot_timeline(lengths, 3, continuous=True)
    assert [sorted(r for r in row if r != -1) for row in timeline] == engine_steps


# ----------------------------------------------------------------- admission

def engine_admits(waiting, num_running, free_blocks, budget, max_num_seqs, block_size, chunked):
    """What the engine's Scheduler admits in the same situation (running sequences need nothing more)."""
    manager = BlockManager(free_blocks + 3, block_size, enable_prefix_caching=False)
    manager.allocate(list(range(3 * block_size)))  # three blocks held by someone else
    scheduler = Scheduler(manager, max_num_seqs, budget, chunked)
    for _ in range(num_running):  # running and done with their tokens: they take no budget this step
        seq = make_seq(1)
        seq.num_computed = 1
        scheduler.running.append(seq)
    queued = [make_seq(n) for n in waiting]
    for seq in queued:
        scheduler.add(seq)
    return [count for seq, count in scheduler.schedule() if seq in queued]


def test_admit_first_come_first_served(impl):
    # the head needs 5 blocks, only 4 are free: the small request behind it waits too
    assert impl.admit([20, 2], 0, free_blocks=4, budget=100, max_num_seqs=8, block_size=4) == []
    assert impl.admit([2, 20, 2], 0, free_blocks=4, budget=100, max_num_seqs=8, block_size=4) == [2]


def test_admit_respects_max_num_seqs(impl):
    assert impl.admit([3, 3, 3, 3], 2, free_blocks=100, budget=100, max_num_seqs=4, block_size=4) == [3, 3]
    assert impl.admit([3], 4, free_blocks=100, budget=100, max_num_seqs=4, block_size=4) == []


def test_admit_chunks_a_long_prompt(impl):
    assert impl.admit([10, 50, 7], 0, free_blocks=100, budget=32, max_num_seqs=8, block_size=16) == [10, 22]
    assert impl.admit([10, 50, 7], 0, free_blocks=100, budget=32, max_num_seqs=8, block_size=16,
                      chunked_prefill=False) == [10]
    assert impl.admit([5], 0, free_blocks=100, budget=0, max_num_seqs=8, block_size=16) == []


@pytest.mark.parametrize("seed", range(6))
def test_admit_equals_the_engine_scheduler_on_random_situations(impl, seed):
    gen = torch.Generator().manual_seed(seed)

    def draw(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    for _ in range(40):
        waiting = [draw(1, 60) for _ in range(draw(1, 6))]
        case = dict(num_running=draw(0, 3), free_blocks=draw(0, 20), budget=draw(1, 120), max_num_seqs=draw(1, 6),
                    block_size=[1, 4, 16][draw(0, 2)])
        chunked = bool(draw(0, 1))
        expected = engine_admits(waiting, case["num_running"], case["free_blocks"], case["budget"],
                                 case["max_num_seqs"], case["block_size"], chunked)
        assert impl.admit(waiting, **case, chunked_prefill=chunked) == expected, (waiting, case, chunked)
