"""Leaks over many requests: the engine's books balance after a mixed soak, and nothing stays behind.

(The full soak, with resident memory over thousands of requests, is `python benchmarks/bench_soak.py`;
its figures are in docs/benchmarks.md.)"""
import asyncio
import random

import pytest

from minfer import LLM, SamplingParams
from minfer.lab.bench.soak import plateau, soak_engine
from minfer.serving.async_engine import AsyncEngine
from minfer.serving.metrics import ServerMetrics


@pytest.fixture(scope="module")
def tiny_llm(make_tiny_llm) -> LLM:
    return make_tiny_llm("random", num_gpu_blocks_override=96, max_num_seqs=8)


def test_mixed_soak_leaks_no_block_and_no_request(tiny_llm):
    result = soak_engine(tiny_llm, num_requests=120, sample_every=20, in_flight=12, seed=3, progress=False)
    counts = result["counts"]
    assert counts["abort"] > 0 and counts["invalid"] > 0 and counts["sampled_n"] > 0 and counts["stop"] > 0
    assert result["refusals_as_expected"], counts  # every invalid request refused, no valid one
    assert counts["errors"] == 0
    assert result["leaked_blocks"] == 0 and result["requests_left"] == 0
    assert result["max_block_discrepancy"] == 0  # at every sample: blocks in use == blocks live sequences hold
    assert all(s["blocks_in_use"] <= 96 for s in result["samples"])
    assert result["plateau"]["heap_growth_mib"] < 1.0  # Python objects do not pile up per request
    engine = tiny_llm.engine
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert len(engine.blocks.cached) <= engine.blocks.num_blocks  # the prefix-cache map is bounded by the pool


def test_async_engine_forgets_finished_failed_and_cancelled_requests(tiny_llm):
    async def main() -> AsyncEngine:
        engine = AsyncEngine(tiny_llm, max_waiting_requests=None)
        metrics = ServerMetrics(engine, "tiny")
        engine.listener = metrics
        await engine.start()
        rng = random.Random(0)

        async def one(i: int) -> None:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(2, 20), ignore_eos=True,
                                    n=rng.choice([1, 1, 2]))
            length = 8 if i % 5 else 100_000  # every fifth fails: a prompt longer than the model's context
            async for _ in engine.generate({"prompt_token_ids": [rng.randrange(1, 500) for _ in range(length)]}, params):
                pass

        tasks = [asyncio.create_task(one(i)) for i in range(40)]
        await asyncio.sleep(0.05)
        for task in tasks[::3]:  # a third of the clients go away mid-way
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, ValueError)]
        assert len(failed) == 8, outcomes  # refused at once, before any client goes away
        for _ in range(100):  # the aborts run on the engine thread within a step or two
            if not tiny_llm.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        await engine.shutdown()
        assert not metrics._seen, "metrics keep state of requests that ended"
        return engine

    engine = asyncio.run(main())
    assert engine.num_unfinished_requests == 0
    assert not tiny_llm.has_unfinished_requests() and not tiny_llm.engine.requests
    blocks = tiny_llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_plateau_tells_flat_from_growing():
    flat = [{"requests": r, "rss_mib": 1000 + (30 if r else 0) + random.Random(r).uniform(-1, 1), "heap_mib": 5.0}
            for r in range(0, 5001, 250)]
    growing = [{"requests": r, "rss_mib": 1000 + 0.05 * r, "heap_mib": 5.0} for r in range(0, 5001, 250)]
    assert plateau(flat)["verdict"] == "plateaued" and abs(plateau(flat)["slope_mib_per_1000"]) < 2
    result = plateau(growing)
    assert result["verdict"] == "still growing" and result["slope_mib_per_1000"] == pytest.approx(50)
    assert plateau(growing[:2])["verdict"] == "too few samples to tell"
