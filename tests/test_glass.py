"""The glass engine's views show the engine's real state, step by step, and its buttons drive it."""
import pytest

from minfer import LLM
from minfer.lab.glass import SHARED_PREFIX, GlassEngine, holders


@pytest.fixture()
def small_llm(tiny_dir) -> LLM:
    # a small pool, small blocks and two sequences a step: sharing, waiting and preemption all show
    return LLM(tiny_dir, dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=40, max_num_seqs=2,
               max_num_batched_tokens=48)


def check_against_engine(llm: LLM, p) -> None:
    engine = llm.engine
    used = [b for b in p.blocks if b.state == "used"]
    assert len(used) == engine.blocks.num_blocks - engine.blocks.num_free_blocks
    live = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    assert sorted(s.label for s in p.sequences) == sorted(f"{s.request_id}/{s.index}" for s in live)
    assert sum(s.state == "running" for s in p.sequences) == len(engine.scheduler.running)
    held = holders(p)
    for view in p.sequences:  # each block a sequence holds is drawn as used, with the sequence among its holders
        for block_id in view.block_table:
            assert p.blocks[block_id].state == "used" and view.label in held[block_id]
    for b in p.blocks:
        assert b.ref_count == engine.blocks.blocks[b.block_id].ref_count
        assert (b.prefix_hash is not None) == (engine.blocks.cached.get(engine.blocks.blocks[b.block_id].hash) == b.block_id)
    assert p.num_used_blocks == len(used) and p.computed_tokens == engine.stats.computed_tokens


def test_the_snapshot_follows_the_engine_step_by_step(small_llm):
    glass = GlassEngine(small_llm, max_tokens=12)
    first = glass.add("What is a block?")
    p = small_llm.engine.snapshot(detail=True)
    assert [s.state for s in p.sequences] == ["waiting"] and not p.last_step
    seen_shared, before = False, small_llm.engine.stats.computed_tokens
    for step in range(40):
        if step == 2:  # the first request's prompt is in the pool now: two more share its prefix
            for prompt in ("What is a page?", "Why share a prefix?"):
                glass.add(prompt)
        if step > 2 and not small_llm.has_unfinished_requests():
            break
        glass.step()
        p = small_llm.engine.snapshot(detail=True)
        check_against_engine(small_llm, p)
        assert sum(count for _, count, _ in p.last_step) == small_llm.engine.stats.computed_tokens - before
        before = small_llm.engine.stats.computed_tokens
        assert len([s for s in p.sequences if s.state == "running"]) <= 2
        seen_shared |= any(b.ref_count > 1 for b in p.blocks)  # the shared prefix, held by two sequences
    assert seen_shared and glass.hits, "a later request found the shared prefix in the cache"
    assert all(b.state != "used" for b in small_llm.engine.snapshot(detail=True).blocks)
    assert any(b.state == "cached" for b in small_llm.engine.snapshot(detail=True).blocks)
    assert first not in small_llm.engine.requests
    timeline = glass.views["timeline"].value  # finished requests stay on the timeline, with their latencies
    assert all(f"<td>{rid}</td><td>length</td>" in timeline for rid in ("0", "1", "2")) and " ms</td>" in timeline


def test_preemption_shows_and_the_buttons_drive_the_engine(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=14, max_num_seqs=2,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    glass = GlassEngine(llm, max_tokens=30)
    glass.share.value = False
    glass.prompt.value = "one two three four five six"
    buttons = {b.description: b for box in glass.box.children if hasattr(box, "children") for b in box.children
               if hasattr(b, "on_click")}
    buttons["add request"].click()
    buttons["add request"].click()
    pools, states = [glass.views["pool"].value], set()
    for _ in range(40):
        buttons["step"].click()
        pools.append(glass.views["pool"].value)
        states |= {s.state for s in llm.engine.snapshot(detail=True).sequences}
        check_against_engine(llm, llm.engine.snapshot(detail=True))
    assert pools[1] != pools[0] and "preempted" in states  # the view moved; 14 blocks cannot hold both
    buttons["add request"].click()
    buttons["step"].click()
    (request_id,) = glass.abort_choice.options
    glass.abort_choice.value = request_id
    buttons["abort"].click()
    assert request_id not in llm.engine.requests and "0 used" in glass.views["pool"].value
    glass.knobs["num_gpu_blocks_override"].value = 64
    buttons["new engine with these knobs"].click()
    assert llm.engine.blocks.num_blocks == 64 and not llm.has_unfinished_requests()
    assert "64 free" in glass.views["pool"].value


def test_shared_prefix_fills_whole_blocks():
    assert len(SHARED_PREFIX.split()) >= 16  # several full blocks at any block size the knobs offer


def test_a_snapshot_stays_as_it_was_taken(small_llm):
    glass = GlassEngine(small_llm, max_tokens=6)
    glass.add("What is a block?")
    glass.step()
    before = small_llm.engine.snapshot(detail=True)
    frozen = (before.sequences, before.blocks, before.computed_tokens)
    glass.step(3)
    after = small_llm.engine.snapshot(detail=True)
    assert after.version > before.version and after.computed_tokens > before.computed_tokens
    assert (before.sequences, before.blocks, before.computed_tokens) == frozen  # the engine moved on, the snapshot did not
    assert before.sequences[0].num_output_tokens < after.sequences[0].num_output_tokens
    assert before.sequences[0].metrics is not after.sequences[0].metrics  # a copy, not the live metrics
