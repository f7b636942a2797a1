"""Decode steps replayed from recorded graphs (`minfer.engine.cuda_graphs`) give the eager engine's results.

Recording a CUDA graph needs a GPU, so here a stand-in recorder runs the step once and "replays" it by
running it again into the same output tensor, as a replayed graph rewrites its output. Everything around
the recording is what runs on a GPU: the fixed buffers each step is copied into, batch sizes padded to a
bucket (extra rows that store nothing and whose logits nobody reads), stale block-table entries left by
earlier steps, one recording per batch size, and the fallback to eager steps when recording fails.
Run in a fresh process with TRITON_INTERPRET=1: the recorded step is the Triton kernel path, interpreted.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import contextlib, random, sys, tempfile, warnings
    import torch
    from minfer import LLM, SamplingParams
    from minfer.engine.cuda_graphs import DecodeGraphs
    from minfer.engine.model_runner import blocks_per_sequence
    from minfer.lab.testing import random_checkpoint

    folder = random_checkpoint(tempfile.mkdtemp(), "tiny")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(2, 30))]} for _ in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (3, 9, 5, 12, 7)]
    recorded, replayed = [], []

    @contextlib.contextmanager
    def no_host_reads():
        # What a CUDA graph cannot record: reading a GPU value back on the host, or building a tensor from
        # Python data (a copy from host memory). Triton's interpreter does both to run kernels on the CPU.
        saved = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "numpy", "__bool__")}
        saved_tensor = torch.tensor

        def guarded(original, name):
            def call(*args, **kwargs):
                if not sys._getframe(1).f_globals.get("__name__", "").startswith("triton"):
                    raise AssertionError(f"{name} inside the recorded step")
                return original(*args, **kwargs)
            return call
        for name, original in saved.items():
            setattr(torch.Tensor, name, guarded(original, name))
        torch.tensor = guarded(saved_tensor, "torch.tensor")
        try:
            yield
        finally:
            for name, original in saved.items():
                setattr(torch.Tensor, name, original)
            torch.tensor = saved_tensor

    def stand_in(run, memory_pool):
        with no_host_reads():
            outputs = run()  # (logits, hidden states or None)
        recorded.append(outputs[0].shape[1])
        def replay():
            replayed.append(outputs[0].shape[1])
            with torch.inference_mode():  # the model's outputs are inference tensors
                for output, new in zip(outputs, run()):
                    if output is not None:
                        output.copy_(new)
        return replay, outputs, memory_pool

    def failing(run, memory_pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    def engine(recorder, **engine_args):
        llm = LLM(folder, dtype="float32", device="cpu", block_size=4, max_num_seqs=5, num_gpu_blocks_override=64,
                  **engine_args)
        with torch.no_grad():
            llm.model.norm.weight.mul_(30)  # random weights give nearly flat logits: make the argmax clear
        runner = llm.engine.runner
        runner.use_kernels = True
        if recorder is not None:
            runner.decode_step = DecodeGraphs(llm.model, runner.pool, 5, blocks_per_sequence(llm.engine.config), recorder)
        return llm

    def generate(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [[lp[t].logprob for t in sorted(lp)] for lp in o.outputs[0].logprobs])
                for o in outs]

    eager = generate(engine(None))
    llm = engine(stand_in)
    graphed = generate(llm)
    for (tokens, logprobs), (tokens_g, logprobs_g) in zip(eager, graphed):
        assert tokens == tokens_g, (tokens, tokens_g)
        assert torch.allclose(torch.tensor(sum(logprobs, [])), torch.tensor(sum(logprobs_g, [])), atol=1e-5)
    graphs = llm.engine.runner.decode_step
    assert graphs.sizes == [1, 2, 4, 8], graphs.sizes
    assert sorted(recorded) == sorted(set(recorded)) == sorted(size for size, _ in graphs.replays), recorded  # one per size
    assert 8 in recorded and 1 in recorded, recorded  # 5 sequences padded to 8 at first, the longest alone at the end
    assert len(replayed) >= 11, replayed  # every decode step after the first of its size replays (12 tokens: 11 decodes)
    assert llm.engine.blocks.num_free_blocks == 64
    print("graph replays == eager:", sum(len(t) for t, _ in graphed), "tokens,", len(replayed), "replays")

    # async scheduling: each decode step's input is filled on the device from the step before, then copied into
    # the graph's buffers and replayed
    replays_before = len(replayed)
    llm = engine(stand_in, async_scheduling=True)
    overlapped = generate(llm)
    for (tokens, logprobs), (tokens_a, logprobs_a) in zip(eager, overlapped):
        assert tokens == tokens_a, (tokens, tokens_a)
        assert torch.allclose(torch.tensor(sum(logprobs, [])), torch.tensor(sum(logprobs_a, [])), atol=1e-5)
    assert len(replayed) - replays_before >= 11 and llm.engine.blocks.num_free_blocks == 64
    print("async scheduling with graph replays == eager")

    llm = engine(failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [tokens for tokens, _ in generate(llm)] == [tokens for tokens, _ in eager]
    assert llm.engine.runner.decode_step.failed and "stream is capturing" in llm.engine.runner.decode_step.failed
    assert sum("run eagerly" in str(w.message) for w in caught) == 1, [str(w.message) for w in caught]
    print("failed recording falls back to eager")

    # Speculative decoding: a verification pass (the last token and k drafts, 1 + k rows per sequence) replays
    # too, each row seeing its sequence up to itself. With an EAGLE head the graph also returns the hidden states
    # the head reads: every sequence is handed the features a solo forward pass over its tokens gives.
    from minfer.engine.engine import Engine
    from minfer.speculative import DraftModelProposer, EagleProposer
    from minfer.speculative.eagle_head import eagle_from_target

    spec_prompts = [{"prompt_token_ids": ([rng.randrange(3, 512) for _ in range(5)] * 4)[:rng.randint(6, 20)]}
                    for _ in range(5)]
    spec_params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 14, 9, 17, 11)]
    llm = engine(None)
    torch.manual_seed(0)
    head = eagle_from_target(llm.model, torch.arange(511, -1, -1), feature_layers=(0,))

    def speculative(proposer, recorder):
        spec = Engine(llm.model, llm.tokenizer, device="cpu", block_size=4, max_num_seqs=5, num_gpu_blocks_override=64,
                      enable_prefix_caching=False, speculative_model=proposer, num_speculative_tokens=3)
        runner, served = spec.runner, []
        runner.use_kernels = True
        if recorder is not None:
            graphs = runner.decode_step = DecodeGraphs(llm.model, runner.pool, 5, blocks_per_sequence(spec.config),
                                                       max_query_len=4, record=recorder)
            serves = graphs.serves
            graphs.serves = lambda step: serves(step) and not served.append(max(s.query_len for s in step.paged.slices))
        requests = llm._make_requests(spec_prompts, spec_params)
        for request in requests:
            spec.add_request(request)
        while spec.has_unfinished_requests():
            spec.step()
        assert spec.blocks.num_free_blocks == 64
        return [r.to_output().outputs[0].token_ids for r in requests], served, spec

    guessed = {False: [], True: []}

    def eagle(graphed):  # the head on the kernel path, its own steps replayed too when graphed
        proposer = EagleProposer(head, 512, block_size=4, use_graphs=graphed, record=stand_in)
        proposer.use_kernels = True
        propose = proposer.propose
        proposer.propose = lambda seqs, ks: guessed[graphed].append(propose(seqs, ks)) or guessed[graphed][-1]
        return proposer

    for name, make in (("[ngram]", lambda graphed: "[ngram]"), ("an EAGLE head", eagle)):
        expected, _, _ = speculative(make(False), None)
        proposer, features = make(True), []
        if name != "[ngram]":
            observe = proposer.observe
            def checked(seq, first, hidden, observe=observe):
                ids = torch.tensor([seq.token_ids_between(0, first + len(hidden))])  # drafts under verification too
                solo = llm.model.hidden_states(ids, torch.arange(ids.shape[1])[None], keep_layers=(0,))[0, first:]
                features.append(torch.allclose(hidden, solo, atol=1e-4))
                observe(seq, first, hidden)
            proposer.observe = checked
        tokens, served, spec = speculative(proposer, stand_in)
        assert tokens == expected, (name, tokens, expected)
        longest = 2 if name == "[ngram]" else 4  # n-gram lookup finds one token to continue here, the head guesses 3
        assert spec.spec_stats.num_draft_tokens > 0 and longest in served, (name, spec.spec_stats.num_draft_tokens, served)
        assert all(features) and (name == "[ngram]" or len(features) > 10), features
        if name != "[ngram]":  # the head's replayed steps guess what its eager steps guess
            drafts = lambda runs: [[tokens for tokens, _ in proposals] for proposals in runs]
            assert drafts(guessed[True]) == drafts(guessed[False]) and len(guessed[True]) > 10, guessed
            assert sorted(size for size, _ in proposer.graphs.replays) == [1, 2, 4, 8], proposer.graphs.replays
        print(f"speculative decoding with {name}: verification passes replayed ({len(served)} steps)")

    # A draft model's steps replay too: the target as its own draft guesses exactly its greedy tokens, so every
    # guess is accepted only if the draft's replayed steps compute what eager ones do.
    def own_draft(recorder):
        proposer = DraftModelProposer(llm.model, 512, block_size=4, use_graphs=recorder is not None,
                                      record=recorder or stand_in)
        proposer.use_kernels = True
        return proposer

    expected, _, _ = speculative(own_draft(None), None)
    draft = own_draft(stand_in)
    tokens, served, spec = speculative(draft, stand_in)
    assert tokens == expected and spec.spec_stats.draft_acceptance_rate == 1.0, spec.spec_stats.draft_acceptance_rate
    assert draft.graphs is not None and draft.graphs.failed is None and len(draft.graphs.replays) >= 2, draft.graphs.replays
    print(f"draft model steps replayed: {sorted(size for size, _ in draft.graphs.replays)} rows")
""")


def test_decode_graphs_replay_the_eager_step():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "graph replays == eager" in done.stdout and "falls back to eager" in done.stdout
    assert "async scheduling with graph replays == eager" in done.stdout
    assert "with [ngram]: verification passes replayed" in done.stdout and "with an EAGLE head: verification" in done.stdout
    assert "draft model steps replayed" in done.stdout


def test_graphs_only_where_they_can_record(random_tiny_dir, tmp_path):
    """On a CPU, enforce_eager=False compiles the step (no CUDA graphs) and the default is eager; MoE models are
    never recorded."""
    from minfer import LLM
    from minfer.engine.compiled_decode import CompiledDecode
    from minfer.engine.cuda_graphs import DecodeGraphs
    from minfer.lab.testing import tiny_moe_checkpoint, word_tokenizer

    llm = LLM(random_tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=16, enforce_eager=False)
    assert isinstance(llm.engine.runner.decode_step, CompiledDecode)
    assert LLM(random_tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=16).engine.runner.decode_step is None
    assert DecodeGraphs.supports(llm.model)
    tiny_moe_checkpoint(str(tmp_path), word_tokenizer(512), "mixtral", vocab_size=512)
    assert not DecodeGraphs.supports(LLM(str(tmp_path), dtype="float32", device="cpu", num_gpu_blocks_override=16).model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records real CUDA graphs: needs a GPU (benchmarks/gpu_check.sh runs it)")
def test_cuda_graphs_on_a_gpu(random_tiny_dir):
    """The real recording: the default (enforce_eager=None) on CUDA records graphs and gives the eager engine's
    tokens and logprobs, with async scheduling too."""
    from minfer import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + 5 * i + 7))} for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (3, 9, 5, 12, 7)]
    results = {}
    for eager, overlap in ((True, False), (None, False), (None, True)):  # eager; graphs; graphs, async scheduling
        llm = LLM(random_tiny_dir, dtype="float32", device="cuda", max_num_seqs=5, enforce_eager=eager,
                  async_scheduling=overlap)
        with torch.no_grad():
            llm.model.norm.weight.mul_(30)  # random weights give nearly flat logits: make the argmax clear
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager, overlap] = [(o.outputs[0].token_ids, [lp[t].logprob for lp in o.outputs[0].logprobs
                                                              for t in sorted(lp)]) for o in outs]
        if not eager:
            graphs = llm.engine.runner.decode_step
            assert graphs is not None and graphs.failed is None, graphs and graphs.failed
            assert (8, None) in graphs.replays and (1, None) in graphs.replays, sorted(graphs.replays)
    for graphed in (results[None, False], results[None, True]):
        for (tokens, logprobs), (tokens_g, logprobs_g) in zip(results[True, False], graphed):
            assert tokens == tokens_g
            assert torch.allclose(torch.tensor(logprobs), torch.tensor(logprobs_g), atol=1e-4)
    # speculative decoding: the verification passes (1 + k rows per sequence) are recorded and replayed too
    repeating = [{"prompt_token_ids": [3 + i, 9, 4, 7] * 5} for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = {}
    for eager in (True, None):
        llm = LLM(random_tiny_dir, dtype="float32", device="cuda", max_num_seqs=5, enforce_eager=eager,
                  speculative_model="[ngram]", num_speculative_tokens=3)
        with torch.no_grad():
            llm.model.norm.weight.mul_(30)
        spec[eager] = [o.outputs[0].token_ids for o in llm.generate(repeating, greedy, use_tqdm=False)]
    graphs = llm.engine.runner.decode_step
    assert graphs.failed is None and graphs.max_query_len == 4 and llm.engine.spec_stats.num_draft_tokens > 0
    assert spec[True] == spec[None]
    # the target as its own draft: the draft's batched steps are recorded too, and every guess is accepted
    from minfer.speculative import DraftModelProposer, SpecDecodeStats

    engine = llm.engine
    engine.proposer, engine.spec_stats = DraftModelProposer(llm.model, llm.config.vocab_size), SpecDecodeStats()
    draft = engine.proposer
    own = [o.outputs[0].token_ids for o in llm.generate(repeating, greedy, use_tqdm=False)]
    assert own == spec[True] and draft.graphs is not None and draft.graphs.failed is None and draft.graphs.replays
    assert engine.spec_stats.draft_acceptance_rate == 1.0


def test_the_decode_path_is_chosen_once_cuda_graphs_by_default_on_cuda(random_tiny_dir):
    """enforce_eager=None: CUDA graphs where a recording can follow the step (CUDA, a dense model on the kernels,
    not tensor-parallel), eager elsewhere; True: eager; False: graphs where they can record, else compiled."""
    from types import SimpleNamespace

    from minfer import LLM
    from minfer.engine.compiled_decode import CompiledDecode
    from minfer.engine.cuda_graphs import DecodeGraphs
    from minfer.engine.model_runner import ModelRunner

    llm = LLM(random_tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=16)
    runner = llm.engine.runner

    def choose(enforce_eager, device="cuda", kernels=True, graphs_allowed=True):
        config = llm.engine.config.__class__(**{**vars(llm.engine.config), "enforce_eager": enforce_eager})
        fake = SimpleNamespace(config=config, device=torch.device(device), model=llm.model, pool=runner.pool,
                               graphs_allowed=graphs_allowed, kernels_on=lambda: kernels)
        return ModelRunner._choose_decode_step(fake)

    assert isinstance(choose(None), DecodeGraphs)  # on CUDA, by default
    assert choose(True) is None
    assert choose(None, device="cpu") is None and isinstance(choose(False, device="cpu"), CompiledDecode)
    assert choose(None, kernels=False) is None  # a learner's attention function: no kernels to record
    assert isinstance(choose(False, kernels=False), CompiledDecode)
    assert choose(None, graphs_allowed=False) is None  # tensor parallelism's rank 0
