"""Async scheduling (minfer.engine.overlap): step n + 1 is launched before step n's tokens are read, with outputs
equal to the synchronous engine's, the same blocks returned and sealed, and nothing read back while launching."""
import argparse
import dataclasses
import random

import pytest
import torch

from minfer import SamplingParams
from minfer.engine import engine as engine_module
from minfer.engine import overlap
from minfer.engine.model_runner import ModelRunner
from minfer.lab.host_sync import DeviceCopies, HostReads
from minfer.sampling_params import StructuredOutputsParams


@pytest.fixture
def tiny_llm(make_tiny_llm):
    return lambda **engine_args: make_tiny_llm("4k", **{"max_model_len": 512, **engine_args})


def workload(seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    """24 requests: greedy and seeded sampling, n = 2, logprobs, prompt logprobs, 1 to 40 new tokens."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(24):
        prompts.append({"prompt_token_ids": [rng.randrange(100, 49152) for _ in range(rng.randint(1, 60))]})
        sampled = dict(temperature=0.9, top_k=40, top_p=0.9, seed=i) if i % 2 else dict(temperature=0)
        params.append(SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, n=2 if i % 5 == 0 else 1,
                                     logprobs=2 if i % 3 == 0 else None, prompt_logprobs=1 if i % 7 == 0 else None,
                                     **sampled))
    return prompts, params


def with_stops(params: list[SamplingParams], outputs) -> list[SamplingParams]:
    """Stops the plain run meets midway: a stop token for some requests, a stop string for others."""
    stopped = []
    for i, (p, out) in enumerate(zip(params, outputs)):
        first = out.outputs[0]
        if i % 4 == 1 and len(first.token_ids) > 6:
            p = dataclasses.replace(p, stop_token_ids=[first.token_ids[5]])
        elif i % 4 == 2 and len(first.text) > 12:
            p = dataclasses.replace(p, stop=[first.text[8:11]])
        stopped.append(p)
    return stopped


def summary(outputs) -> tuple[list, list]:
    """(what must be equal: ids, text, finish and stop reasons; the log-probabilities as
    (token, value) pairs, equal up to rounding: a preempted sequence is recomputed in other batches)."""
    exact, logprobs = [], []
    for out in outputs:
        for c in out.outputs:
            exact.append((out.request_id, c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason))
            logprobs += [(t, lp.logprob) for entry in c.logprobs or [] for t, lp in entry.items()]
        logprobs += [(t, lp.logprob) for entry in out.prompt_logprobs or [] if entry for t, lp in entry.items()]
    return exact, logprobs


def relabel(outputs) -> None:
    for i, out in enumerate(outputs):  # request ids count per LLM: compare by position
        out.request_id = str(i)


@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_async_scheduling_equals_the_synchronous_engine(tiny_llm, pool):
    """Same tokens, text, finish and stop reasons, logprobs and prompt logprobs; every block back in the pool,
    the same prefix-cache entries sealed; a tight pool preempts sequences with a token in flight."""
    engine_args = (dict(num_gpu_blocks_override=512) if pool == "roomy" else
                   dict(num_gpu_blocks_override=24, block_size=8, max_num_seqs=8, max_num_batched_tokens=64))
    prompts, params = workload()
    reference = tiny_llm(**engine_args)
    params = with_stops(params, reference.generate(prompts, params, use_tqdm=False))
    results, engines = [], []
    for async_scheduling in (False, True):
        llm = tiny_llm(async_scheduling=async_scheduling, **engine_args)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        relabel(outputs)
        results.append(summary(outputs))
        engines.append(llm.engine)
    (exact, logprobs), (exact_overlapped, logprobs_overlapped) = results
    assert exact_overlapped == exact
    assert [t for t, _ in logprobs_overlapped] == [t for t, _ in logprobs] and len(logprobs) > 100
    assert [v for _, v in logprobs_overlapped] == pytest.approx([v for _, v in logprobs], abs=1e-3)
    finishes = {row[4] for row in exact}
    assert finishes == {"stop", "length"}  # both kinds of end were exercised
    sync, overlapped = engines
    for engine in engines:
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.has_unfinished_requests()
        assert engine.in_flight is None
    sealed = [overlapped.blocks.blocks[i] for i in overlapped.blocks.cached.values()]
    assert sealed and all(len(b.token_ids) == overlapped.blocks.block_size for b in sealed)  # full blocks, known tokens
    if pool == "roomy":  # (a tight pool evicts cached blocks, each engine its own)
        assert sorted(overlapped.blocks.cached) == sorted(sync.blocks.cached)
    else:
        assert overlapped.scheduler.num_preemptions > 0


def test_a_sequence_that_stops_costs_one_wasted_row(tiny_llm):
    """A sequence ended by a stop token was already scheduled for the next step: one row computed and dropped.
    One ended by max_tokens is known to end and is not scheduled. (No prefix cache: no hits to differ.)"""
    prompts, params = workload(seed=1)
    params = [dataclasses.replace(p, n=1, prompt_logprobs=None) for p in params]
    reference = tiny_llm(enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    params = [dataclasses.replace(p, stop_token_ids=[out.outputs[0].token_ids[3]]) if i % 2 and len(out.outputs[0].token_ids) > 5
              else p for i, (p, out) in enumerate(zip(params, reference))]
    computed = []
    for async_scheduling in (False, True):
        llm = tiny_llm(enable_prefix_caching=False, async_scheduling=async_scheduling)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        computed.append(llm.engine.stats.computed_tokens)
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in outputs)
    assert stopped >= 4
    assert computed[1] - computed[0] == stopped


def test_an_abort_while_a_token_is_in_flight(tiny_llm):
    """The aborted request ends with its tokens so far; the others are unchanged; its blocks come back."""
    prompts, params = workload(seed=2)
    prompts, params = prompts[:4], [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 4
    alone = tiny_llm().generate(prompts[1:], params[1:], use_tqdm=False)
    llm = tiny_llm(async_scheduling=True, num_gpu_blocks_override=64)
    request_ids = [llm.add_request(prompts[i], params[i]) for i in range(4)]
    engine = llm.engine
    for _ in range(6):
        engine.step()
    victim = engine.requests[request_ids[0]].seqs[0]
    assert victim.num_pending == 1 and engine.in_flight is not None
    llm.abort_request(request_ids[0])
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert victim.finish_reason == "abort" and len(victim.output_ids) < 30
    assert [finals[request_ids[i]].outputs[0].token_ids for i in (1, 2, 3)] == [o.outputs[0].token_ids for o in alone]
    assert engine.blocks.num_free_blocks == 64


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_launching_a_step_reads_nothing_back(tiny_llm, monkeypatch, temperature):
    """Preparing, running and sampling the next step reads no tensor into Python (on a GPU each read would wait
    for the step in flight) and moves host data to the device only through `to_device` (pinned, queued); the
    step's tokens reach the host once, when the engine reads them."""
    launches, reads, copies, launch = [], [], [], engine_module.launch

    def counted_launch(*args, **kwargs):
        with HostReads() as host_reads, DeviceCopies() as device_copies:
            step = launch(*args, **kwargs)
        reads.append(host_reads.count)
        copies.extend(device_copies.outside)
        launches.append(step)
        return step

    monkeypatch.setattr(engine_module, "launch", counted_launch)
    llm = tiny_llm(async_scheduling=True)
    prompts, _ = workload(seed=3)
    params = SamplingParams(temperature=temperature, top_k=20, seed=1, max_tokens=12, ignore_eos=True)
    llm.generate(prompts[:6], params, use_tqdm=False)
    assert len(launches) >= 12 and reads == [0] * len(launches) and copies == []
    assert any(step.step.pending_rows is not None for step in launches)  # inputs taken from a step in flight


def test_reading_a_step_reads_only_its_own_copy_to_the_host(tiny_llm, monkeypatch):
    """A step's tokens are read from the copy its launch queued (`to_host`: on a GPU it waits for that step
    alone), never from the device tensor (a read that would also wait for the step launched after it)."""
    read, result = [], overlap.InFlightStep.result

    def recorded(step):
        with HostReads() as host_reads:
            output = result(step)
        read.append((step, host_reads.tensors))
        return output

    monkeypatch.setattr(overlap.InFlightStep, "result", recorded)
    prompts, _ = workload(seed=4)
    tiny_llm(async_scheduling=True).generate(prompts[:4], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(read) >= 6
    for step, tensors in read:
        assert tensors and all(t is step.tokens.host for t in tensors)


def test_a_launch_that_raises_leaves_the_step_in_flight_to_be_read(tiny_llm, monkeypatch):
    """One forward pass raises (a transient out-of-memory, say); the caller goes on stepping: every request ends
    with the tokens of a run without the failure, and every block comes back."""
    prompts, _ = workload(seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    clean = tiny_llm(async_scheduling=True).generate(prompts[:3], params, use_tqdm=False)
    forward, calls, errors = ModelRunner.forward, [0], []

    def flaky(runner, step, drawn_before=None):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("out of memory")
        return forward(runner, step, drawn_before)

    monkeypatch.setattr(ModelRunner, "forward", flaky)
    llm = tiny_llm(async_scheduling=True, num_gpu_blocks_override=64)
    request_ids = [llm.add_request(prompt, params) for prompt in prompts[:3]]
    finals = {}
    for _ in range(40):
        if not llm.engine.has_unfinished_requests():
            break
        try:
            finals.update((out.request_id, out) for out in llm.engine.step() if out.finished)
        except RuntimeError as exc:
            errors.append(str(exc))
    assert errors == ["out of memory"]
    assert [finals[r].outputs[0].token_ids for r in request_ids] == [o.outputs[0].token_ids for o in clean]
    assert llm.engine.blocks.num_free_blocks == 64 and llm.engine.in_flight is None


def test_a_request_whose_prompt_scoring_fails_fails_alone(tiny_llm, monkeypatch):
    """Scoring a prompt's chunk raises: that request ends with "error" even though its next chunk is already in
    flight; the request beside it is unaffected."""
    logprobs_of = engine_module.logprobs_of

    def broken(logits, token_ids, num_top, tokenizer):
        if len(token_ids) > 1:  # prompt scoring (a sampled token's logprobs come one row at a time)
            raise RuntimeError("scoring failed")
        return logprobs_of(logits, token_ids, num_top, tokenizer)

    monkeypatch.setattr(engine_module, "logprobs_of", broken)
    llm = tiny_llm(async_scheduling=True, max_num_batched_tokens=32, num_gpu_blocks_override=64)
    fine = llm.add_request({"prompt_token_ids": list(range(200, 210))}, SamplingParams(max_tokens=8, temperature=0))
    scored = llm.add_request({"prompt_token_ids": list(range(300, 400))},
                             SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=1))
    finals = {}
    while llm.engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in llm.engine.step() if out.finished)
    assert finals[scored].outputs[0].finish_reason == "error"
    assert finals[fine].outputs[0].finish_reason == "length" and len(finals[fine].outputs[0].token_ids) == 8
    assert llm.engine.blocks.num_free_blocks == 64


def test_an_engine_with_nothing_left_holds_no_step(tiny_llm):
    """A stop token ends the last request while its next row is in flight: that row is read before generate
    returns, so the engine reports nothing unfinished and holds no step."""
    prompt = {"prompt_token_ids": list(range(1000, 1012))}
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    tokens = tiny_llm().generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = tiny_llm(async_scheduling=True)
    out = llm.generate(prompt, dataclasses.replace(params, stop_token_ids=[tokens[3]]), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert out.outputs[0].finish_reason == "stop" and ids == tokens[:len(ids)] and len(ids) < len(tokens)
    assert llm.engine.in_flight is None and not llm.engine.has_unfinished_requests()


def test_async_scheduling_refuses_what_needs_the_previous_token_on_the_host(tiny_llm):
    with pytest.raises(ValueError, match="async_scheduling works without speculative decoding"):
        tiny_llm(async_scheduling=True, speculative_model="[ngram]", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="with tensor_parallel_size=1"):
        tiny_llm(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        tiny_llm(async_scheduling="yes")
    llm = tiny_llm(async_scheduling=True)
    shape = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="structured_outputs is not supported with async_scheduling"):
        llm.generate("Is it?", shape, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_flag_has_vllms_spelling():
    from minfer.config import add_engine_arguments, engine_kwargs_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs_from_args(parser.parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert engine_kwargs_from_args(parser.parse_args([]))["async_scheduling"] is False


def test_to_device_keeps_values_and_dtype():
    from minfer.host_copy import to_device

    made = to_device([[1, 2], [3, 4]], "cpu", torch.int32)
    assert made.dtype == torch.int32 and made.tolist() == [[1, 2], [3, 4]]
    tensor = torch.arange(5)
    assert to_device(tensor, "cpu") is tensor  # on the CPU: no copy at all
    assert to_device(tensor, torch.device("cpu"), torch.float32).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    if torch.cuda.is_available():  # pinned and queued, then the same values
        assert to_device(tensor, "cuda").cpu().tolist() == tensor.tolist()


def test_to_host_is_a_copy_that_arrives():
    from minfer.host_copy import to_host

    tensor = torch.arange(6)
    copy = to_host(tensor)
    tensor += 1  # later work on the device does not reach the copy
    assert copy.wait().tolist() == [0, 1, 2, 3, 4, 5]
    if torch.cuda.is_available():
        on_device = torch.arange(6, device="cuda")
        copy = to_host(on_device)
        assert copy.host.is_pinned() and copy.wait().tolist() == [0, 1, 2, 3, 4, 5]
