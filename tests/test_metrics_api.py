"""`LLM.get_metrics()`: vLLM's reader records, read from one engine snapshot."""
from minfer import SamplingParams
from minfer.metrics import Counter, Gauge, Vector

REPEATING = "a b c a b c a b c a b c a b c"  # n-gram lookup finds its drafts in the prompt


def by_name(metrics) -> dict:
    names = [m.name for m in metrics]
    assert len(names) == len(set(names)), names
    return {m.name.removeprefix("minfer:"): m for m in metrics}


def test_metrics_without_speculation_are_the_engine_state(make_tiny_llm):
    llm = make_tiny_llm(num_gpu_blocks_override=64)
    llm.add_request("one two three", SamplingParams(max_tokens=4))
    llm.step()  # the prompt is in, the request still runs
    m = by_name(llm.get_metrics())
    assert set(m) == {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                      "gpu_prefix_cache_hit_rate", "num_preemptions"}
    assert isinstance(m["num_requests_running"], Gauge) and m["num_requests_running"].value == 1
    assert 0 < m["kv_cache_usage_perc"].value <= 1
    assert isinstance(m["num_preemptions"], Counter) and m["num_preemptions"].value == 0
    assert all(x.labels == {"model_name": llm.engine.config.model} for x in m.values())
    while llm.has_unfinished_requests():
        llm.step()
    m = by_name(llm.get_metrics())
    assert m["num_requests_running"].value == 0 and m["kv_cache_usage_perc"].value == 0


def test_speculative_counters_match_the_engine_stats(make_tiny_llm):
    llm = make_tiny_llm(num_gpu_blocks_override=64, speculative_model="[ngram]", num_speculative_tokens=3)
    assert by_name(llm.get_metrics())["spec_decode_num_drafts"].value == 0
    llm.generate([REPEATING, REPEATING + " a"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    m, stats = by_name(llm.get_metrics()), llm.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the test measures something
    assert m["spec_decode_num_drafts"].value == stats.num_drafts
    assert m["spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    assert m["spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens
    per_position = m["spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_position, Vector) and 1 <= len(per_position.values) <= 3
    assert sum(per_position.values) == stats.num_accepted_tokens
    assert per_position.values == sorted(per_position.values, reverse=True)  # position i needs the ones before it

    before = llm.engine.snapshot().spec_decode  # a snapshot's counts stay as they were
    counts = (before.num_drafts, list(before.num_accepted_tokens_per_pos))
    llm.generate(REPEATING, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert llm.engine.spec_stats.num_drafts > counts[0]
    assert (before.num_drafts, before.num_accepted_tokens_per_pos) == counts
