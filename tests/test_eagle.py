"""The EAGLE draft head: it loads, it fits only its own target, and speculation with it stays lossless
(greedy output equals plain decoding, with the shipped head and with a head that guesses garbage),
through preemption, prefix-cache hits and aborts, with every sequence's state freed at the end."""
import importlib.util
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.config import EngineConfig
from minfer.engine.engine import Engine
from minfer.lab.host_sync import DeviceCopies
from minfer.kv_cache import KVCache
from minfer.lab.distill import chained_guesses
from minfer.speculative import EagleProposer, make_proposer
from minfer.speculative.eagle_head import EAGLE, EAGLE_DIR, eagle_from_target, load_eagle, save_eagle

VOCAB = 512  # tiny_small_vocab_dir's
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_engine(llm, prompts, params, proposer=None, k=0, num_blocks=512, block_size=16, **kwargs):
    engine = Engine(llm.model, llm.tokenizer, device="cpu", num_gpu_blocks_override=num_blocks, block_size=block_size,
                    speculative_model=proposer, num_speculative_tokens=k if proposer is not None else None, **kwargs)
    requests = llm._make_requests(prompts, params)
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks.num_free_blocks == num_blocks
    return [r.to_output().outputs[0].token_ids for r in requests], engine


@pytest.fixture(scope="module")
def tiny(tiny_small_vocab_dir):
    return LLM(tiny_small_vocab_dir, dtype="float32", device="cpu", max_model_len=512)


def random_head(target, seed=0):
    torch.manual_seed(seed)
    return eagle_from_target(target, torch.arange(target.config.vocab_size - 1, -1, -1))


def test_head_shapes_and_save_load_roundtrip(tiny, tmp_path):
    head = random_head(tiny.model)
    features, ids = torch.randn(2, 5, 64), torch.randint(0, VOCAB, (2, 5))
    predicted = head(features, ids, torch.arange(5)[None])
    assert predicted.shape == (2, 5, 64) and head.logits(predicted).shape == (2, 5, VOCAB)
    assert head.embed_tokens is tiny.model.embed_tokens  # shared, not copied
    save_eagle(head, tmp_path / "head", {"target": "tiny"})
    loaded = load_eagle(str(tmp_path / "head"), tiny.model)
    torch.testing.assert_close(loaded(features, ids, torch.arange(5)[None]), predicted, atol=0.05, rtol=0.05)  # bf16 file
    assert torch.equal(loaded.head_token_ids, head.head_token_ids)
    assert isinstance(make_proposer(str(tmp_path / "head"), tiny.model, tiny.tokenizer, 512, torch.float32,
                                    torch.device("cpu")), EagleProposer)


@torch.no_grad()
@pytest.mark.parametrize("num_layers", [1, 2])
def test_the_training_time_test_guesses_as_the_engine_does(tiny, num_layers):
    """ChainCache runs every chain's j-th guess in one call; the engine makes them one after another,
    each reading the guess before it, over a cache of the target's rows (EagleProposer)."""
    torch.manual_seed(0)
    head = eagle_from_target(tiny.model, torch.arange(VOCAB - 1, -1, -1), num_layers=num_layers)
    features, ids = torch.randn(1, 9, 64), torch.randint(0, VOCAB, (1, 10))  # row t reads (f_t, token t+1)
    chains, depth = 9, 3
    together = chained_guesses(head, features, ids, depth)
    for t in range(chains - depth + 1):
        steps = KVCache(head.config, 1, 16)
        guess = head(features[:, :t + 1], ids[:, 1:t + 2], torch.arange(t + 1)[None], steps)[:, -1:]
        for j in range(depth):
            if j:  # the next guess reads this chain's last predicted feature and the next true token
                guess = head(guess, ids[:, t + j + 1:t + j + 2], torch.tensor([[t + j]]), steps)
            torch.testing.assert_close(together[j][:, t:t + 1], guess, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("num_layers", [1, 2])
def test_the_engine_guesses_as_the_head_does(tiny, num_layers):
    """Every proposal the engine makes (packed over sequences, paged K/V per layer of the head) is what the
    head guesses for that sequence alone: its rows over the target's features, then each guess fed back."""
    torch.manual_seed(0)
    head = eagle_from_target(tiny.model, torch.arange(VOCAB - 1, -1, -1), num_layers=num_layers)
    proposer = EagleProposer(head, VOCAB, block_size=4)
    same, propose = [], proposer.propose

    def checked(seqs, num_tokens):
        made = propose(seqs, num_tokens)
        for seq, k, (guesses, _) in zip(seqs, num_tokens, made):
            if not guesses:
                continue
            state, newest = proposer.state[seq], seq.num_tokens - 1
            cache, rows = KVCache(head.config, 1, 512), newest - state.start
            feature = head(state.features[None, state.start:newest], torch.tensor([seq.token_ids_between(
                state.start + 1, newest + 1)]), torch.arange(rows)[None], cache)[:, -1:]
            wanted = []
            for j in range(k):
                token = head.head_token_ids[head.logits(feature).argmax(-1)]
                wanted.append(token.item())
                feature = head(feature, token, torch.tensor([[rows + j]]), cache)
            same.append(list(guesses) == wanted)
        return made

    proposer.propose = checked
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]} for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True) for _ in prompts]
    plain, _ = run_engine(tiny, prompts, params)
    spec, engine = run_engine(tiny, prompts, params, proposer, 3, max_num_seqs=6, block_size=4)
    assert spec == plain and len(same) > 10 and all(same)
    assert proposer.blocks.pool.k.shape[0] == num_layers


@torch.no_grad()
def test_a_grown_head_starts_where_the_saved_one_was(tiny):
    """train_eagle.py --init HEAD --head-layers 2: the added layer starts as nothing, then learns."""
    spec = importlib.util.spec_from_file_location("train_eagle", BENCHMARKS / "train_eagle.py")
    sys.path.insert(0, str(BENCHMARKS))  # it imports its sibling train_draft
    try:
        train_eagle = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train_eagle)
    finally:
        sys.path.remove(str(BENCHMARKS))
    saved = random_head(tiny.model)
    grown = train_eagle.grown_head(saved, tiny.model, (), 2)
    features, ids, positions = torch.randn(1, 6, 64), torch.randint(0, VOCAB, (1, 6)), torch.arange(6)[None]
    assert len(grown.layers) == 2
    torch.testing.assert_close(grown(features, ids, positions), saved(features, ids, positions))
    with pytest.raises(ValueError, match="the saved head has 2 layers"):
        train_eagle.grown_head(grown, tiny.model, (), 1)


@torch.no_grad()
def test_features_take_room_as_the_sequence_grows(tiny):
    """A sequence's feature buffer grows with it (doubling), not to prompt + max_tokens up front: memory the KV
    budget does not count."""
    proposer = EagleProposer(random_head(tiny.model), VOCAB)
    engine = Engine(tiny.model, tiny.tokenizer, device="cpu", num_gpu_blocks_override=64, speculative_model=proposer,
                    num_speculative_tokens=3)
    (request,) = tiny._make_requests([{"prompt_token_ids": [3, 1, 4, 1, 5]}], [SamplingParams(max_tokens=400, ignore_eos=True)])
    engine.add_request(request)
    sizes = []
    for _ in range(12):
        engine.step()
        sizes.append(len(proposer.state[request.seqs[0]].features))
    seq = request.seqs[0]
    assert sizes[0] < 16 and sizes[-1] < 2 * seq.num_tokens and sizes == sorted(sizes)
    engine.abort_request(request.request_id)
    assert not proposer.state


@torch.no_grad()
def test_a_gap_in_the_features_restarts_the_head_after_it(tiny):
    """Features 0..15 arrive, then 48..63 (a preempted sequence readmitted with a longer prefix-cache hit): the
    head guesses from 48 on, as for a sequence whose first 48 tokens came from the cache, never from the rows
    in between that no feature reached."""
    head = random_head(tiny.model)
    requests = tiny._make_requests([{"prompt_token_ids": list(range(1, 65))}] * 2,
                                   [SamplingParams(temperature=0, max_tokens=8)] * 2)
    gap, cached = (r.seqs[0] for r in requests)
    states = tiny.model.hidden_states(torch.tensor([gap.token_ids]), torch.arange(64)[None])[0]
    with_gap, from_cache = EagleProposer(head, VOCAB), EagleProposer(head, VOCAB)
    with_gap.observe(gap, 0, states[:16])
    with_gap.observe(gap, 48, states[48:])
    from_cache.observe(cached, 48, states[48:])
    assert with_gap.state[gap].start == 48
    assert with_gap.propose([gap], [3])[0][0] == from_cache.propose([cached], [3])[0][0]


def test_a_head_for_another_model_is_refused(tiny, llm, tmp_path):
    save_eagle(random_head(tiny.model), tmp_path / "head", {})
    with pytest.raises(ValueError, match=r"hidden_size 64.*this target has hidden_size 576"):
        LLM("smollm2-135m", dtype="float32", device="cpu", speculative_model=str(tmp_path / "head"),
            num_speculative_tokens=3)
    with pytest.raises(ValueError, match="features of size 576, the target's are 64"):
        make_proposer(load_eagle(EAGLE, llm.model), tiny.model, tiny.tokenizer, 512, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="no EAGLE head at"):
        load_eagle(str(tmp_path / "nowhere"), tiny.model)
    with pytest.raises(ValueError, match="method 'draft_model', 'eagle' or none"):
        EngineConfig.from_kwargs("LLM()", speculative_config={"method": "eagle", "num_speculative_tokens": 3})
    not_a_head = EngineConfig.from_kwargs("LLM()", speculative_config={
        "method": "eagle", "model": "smollm2-135m-draft", "num_speculative_tokens": 3}).speculative_model
    with pytest.raises(ValueError, match="method 'eagle' needs an EAGLE head.*got 'smollm2-135m-draft'.*'draft_model'"):
        make_proposer(not_a_head, llm.model, llm.tokenizer, 512, torch.float32, torch.device("cpu"))


def test_shipped_head_loads_and_is_small(llm):
    size = os.path.getsize(EAGLE_DIR / "model.safetensors")
    assert size <= 20 * 2**20
    head = load_eagle(EAGLE, llm.model)
    assert len(head.layers) == 1 and head.layers[0].self_attn.num_kv_heads == 3 and head.fc.weight.shape == (576, 1152)
    assert head.lm_head.weight.shape[0] == len(head.head_token_ids) < llm.config.vocab_size


def test_greedy_with_the_shipped_head_equals_plain_and_guesses_well(llm):
    """The shipped head through LLM and vLLM's speculative_config; then the same head with its guesses
    mapped to the wrong tokens: still the plain tokens, far fewer accepted."""
    prompts = [llm.chat_prompt([{"role": "user", "content": q}]) for q in ("Explain how rainbows form.",
                                                                          "Tell me about the moon.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = LLM("smollm2-135m", dtype="float32", device="cpu", max_num_seqs=2,
               speculative_config={"method": "eagle", "model": EAGLE, "num_speculative_tokens": 4})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == plain
    good = spec.engine.spec_stats.alpha
    assert good > 0.14  # measured 0.44 (a head mapped to the wrong tokens: 0.0)
    assert not spec.engine.proposer.state  # every sequence's features and cache freed
    garbage = load_eagle(EAGLE, llm.model)
    garbage.head_token_ids = garbage.head_token_ids.roll(1)
    bad, engine = run_engine(llm, prompts, [params] * 2, garbage, 4)
    assert bad == plain
    assert engine.spec_stats.alpha < good / 4


def test_preemption_prefix_hits_and_aborts_keep_it_lossless(tiny):
    """A tight pool preempts sequences mid-speculation, repeated prompts hit the prefix cache (their
    features never arrive), an abort ends one early: greedy output still equals plain decoding."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]} for _ in range(6)] * 2
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 50), ignore_eos=True) for _ in prompts]
    plain, _ = run_engine(tiny, prompts, params, num_blocks=400, block_size=4)
    proposer = EagleProposer(random_head(tiny.model), VOCAB)
    spec, engine = run_engine(tiny, prompts, params, proposer, 3, num_blocks=40, block_size=4, max_num_seqs=8,
                              max_num_batched_tokens=32, enable_prefix_caching=True)
    assert spec == plain
    assert engine.scheduler.num_preemptions > 0 and engine.prefix_hit_rate > 0
    assert engine.spec_stats.num_draft_tokens > 0 and not proposer.state
    engine = Engine(tiny.model, tiny.tokenizer, device="cpu", num_gpu_blocks_override=64,
                    speculative_model=proposer, num_speculative_tokens=3)
    request = tiny._make_requests([prompts[0]], [SamplingParams(max_tokens=40, ignore_eos=True)])[0]
    engine.add_request(request)
    for _ in range(3):
        engine.step()
    assert proposer.state
    engine.abort_request(request.request_id)
    assert not proposer.state


def test_every_sequence_is_handed_its_own_features(tiny):
    """In a batch that mixes verification passes with plain decodes of different lengths (the step's
    inputs are packed in another order than the batch's), each sequence observes the target's hidden
    states at its own positions."""
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]} for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(2, 24), ignore_eos=True) for _ in prompts]
    proposer = EagleProposer(random_head(tiny.model), VOCAB)
    seen, observe = [], proposer.observe

    def checked(seq, first, hidden):
        ids = torch.tensor([seq.token_ids_between(0, first + len(hidden))])  # drafts under verification included
        solo = tiny.model.hidden_states(ids, torch.arange(ids.shape[1])[None])[0, first:]
        seen.append(torch.allclose(hidden, solo, atol=1e-4))
        observe(seq, first, hidden)

    proposer.observe = checked
    run_engine(tiny, prompts, params, proposer, 3, max_num_seqs=8)
    assert len(seen) > 8 and all(seen)


@torch.no_grad()
def test_a_head_that_reads_an_earlier_layer_too(tiny, tmp_path):
    """EAGLE-3's features: the target hands over layer 0's output before the last one's; fuse starts as the
    last layer alone (the guesses of the same head without it), is saved and loaded, and speculation with
    it stays lossless."""
    ids, positions = torch.randint(0, VOCAB, (1, 7)), torch.arange(7)[None]
    states = tiny.model.hidden_states(ids, positions, keep_layers=(0,))
    assert states.shape == (1, 7, 128)
    torch.testing.assert_close(states[..., 64:], tiny.model.hidden_states(ids, positions))
    last_only = random_head(tiny.model)
    head = eagle_from_target(tiny.model, last_only.head_token_ids, (0,))
    head.load_state_dict(last_only.state_dict(), strict=False)
    torch.testing.assert_close(head(head.read_features(states), ids, positions), last_only(states[..., 64:], ids, positions))
    head.fuse.weight.normal_(0, 0.1)  # now layer 0 counts
    save_eagle(head, tmp_path / "head", {})
    loaded = load_eagle(str(tmp_path / "head"), tiny.model)
    assert loaded.feature_layers == (0,)
    torch.testing.assert_close(loaded.read_features(states), head.read_features(states), atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match=r"feature_layers \[1\].*0\.\.0 here"):
        eagle_from_target(tiny.model, last_only.head_token_ids, (1,))

    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]} for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) for _ in prompts]
    plain, _ = run_engine(tiny, prompts, params)
    proposer = EagleProposer(loaded, VOCAB)
    widths, observe = set(), proposer.observe
    proposer.observe = lambda seq, first, hidden: (widths.add(hidden.shape[-1]), observe(seq, first, hidden))
    spec, engine = run_engine(tiny, prompts, params, proposer, 3)
    assert spec == plain and widths == {128} and engine.spec_stats.num_draft_tokens > 0


def test_sampling_with_the_head_is_seeded(tiny):
    """Seeded sampling repeats; the head's proposals move host data to the device only queued (`to_device`)."""
    prompt = {"prompt_token_ids": [3, 1, 4, 1, 5]}
    params = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=30, ignore_eos=True)
    proposers, copies = [EagleProposer(random_head(tiny.model), VOCAB) for _ in range(2)], []
    propose = proposers[0].propose

    def watched(*args):
        with DeviceCopies() as device_copies:
            proposals = propose(*args)
        copies.extend(device_copies.outside)
        return proposals

    proposers[0].propose = watched
    runs = [run_engine(tiny, [prompt], [params], proposer, 3)[0] for proposer in proposers]
    assert runs[0] == runs[1] and len(runs[0][0]) == 30
    assert copies == []
