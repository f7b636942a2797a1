"""Chapter 00: TTFT / TPOT from timestamps, weight bytes, bandwidth utilisation."""
import random
import time

import pytest
import torch
from torch import nn

from minfer.lab.bench import decode_speed as benchmark
from minfer.outputs import RequestMetrics


def random_timeline(n_tokens: int, seed: int) -> tuple[float, list[float]]:
    rng = random.Random(seed)
    arrival = rng.uniform(0, 100)
    t = arrival + rng.uniform(0.05, 2.0)  # prefill
    times = [t]
    for _ in range(n_tokens - 1):
        t += rng.uniform(0.001, 0.2)
        times.append(t)
    return arrival, times


@pytest.mark.parametrize("seed", range(3))
def test_ttft_and_tpot_match_engine_metrics(impl, seed):
    arrival, times = random_timeline(n_tokens=7 + seed, seed=seed)
    engine = RequestMetrics(arrival, first_token_time=times[0], finished_time=times[-1], num_output_tokens=len(times))
    assert impl.ttft(arrival, times) == pytest.approx(engine.ttft)
    assert impl.tpot(times) == pytest.approx(engine.tpot)


def test_tpot_ignores_the_prefill_wait(impl):
    # the same decode gaps after a long or a short prefill give the same TPOT
    arrival, times = random_timeline(6, seed=11)
    later = [t + 5.0 for t in times]
    assert impl.tpot(later) == pytest.approx(impl.tpot(times))
    assert impl.ttft(arrival, later) == pytest.approx(impl.ttft(arrival, times) + 5.0)


def test_tpot_needs_two_tokens(impl):
    with pytest.raises(ValueError):
        impl.tpot([1.5])


def test_token_timestamps_from_the_real_engine(impl, llm):
    passes = []  # when each forward pass of the model began
    hook = llm.model.register_forward_pre_hook(lambda module, args: passes.append(time.perf_counter()))
    try:
        arrival, times = impl.token_timestamps(llm, "The capital of France is", max_tokens=4)
    finally:
        hook.remove()
    assert len(times) == 4  # end-of-sequence must not cut it short
    assert arrival < times[0] and all(a < b for a, b in zip(times, times[1:]))
    assert len(passes) >= 4, f"the model ran {len(passes)} forward passes for 4 tokens"
    # A token reaches us after the pass that computed it and before the pass of the next one begins: the stamps
    # interleave with the passes. Stamps taken once the whole generation is over all come after the last pass.
    # (Only the order of events is compared, so a slow or busy machine cannot make a right answer fail.)
    assert arrival < passes[0], "arrival must be taken before the request is made"
    assert times[0] < passes[-1], "the first token's stamp comes after the model's last pass: stamp each token as it arrives"
    for j in range(3):
        assert any(times[j] < start < times[j + 1] for start in passes), \
            f"no forward pass began between the stamps of tokens {j} and {j + 1}: stamp each token as it arrives"


def test_weight_bytes_of_the_real_model(impl, llm):
    assert impl.weight_bytes(llm.model) == benchmark.weight_bytes(llm.model)
    # by hand, in float32: 30 layers of q, k, v, o (576 x (576 + 192 + 192 + 576)), gate, up, down (3 x 576 x 1536)
    # and two norms, then the final norm and the tied head (49152 x 576), which the embedding shares
    assert impl.weight_bytes(llm.model) == 4 * (30 * (576 * 1536 + 3 * 576 * 1536 + 2 * 576) + 576 + 49152 * 576)


class Toy(nn.Module):
    """The parts of a LlamaModel that matter here: an embedding, a layer, a head (tied or not)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4, bias=False)
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_weight_bytes_counts_what_a_step_reads(impl, tied, dtype):
    model = Toy(tied).to(dtype)
    assert impl.weight_bytes(model) == benchmark.weight_bytes(model)
    # the 4x4 layer and the 10x4 head, each once; an untied embedding is read a row at a time
    assert impl.weight_bytes(model) == (16 + 40) * dtype.itemsize


def test_bandwidth_utilization_matches_the_benchmark(impl):
    for model_bytes, tokens_per_s, bandwidth in [(1e9, 100.0, 200e9), (270e6, 30.0, 50e9), (540e6, 12.5, 20e9)]:
        expected = benchmark.model_bandwidth_utilisation(model_bytes, 1 / tokens_per_s, bandwidth)
        assert impl.bandwidth_utilization(model_bytes, tokens_per_s, bandwidth) == pytest.approx(expected)
    # 1 GB of weights at 100 tokens/s moves 100 GB/s: half of a 200 GB/s memory
    assert impl.bandwidth_utilization(1e9, 100.0, 200e9) == pytest.approx(0.5)
