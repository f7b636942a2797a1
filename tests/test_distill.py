"""The distilled draft: the loss, the top-K head, training, saving and loading by name."""
import math

import pytest
import torch

from minfer.lab.distill import distillation_loss, greedy_acceptance, select_head_tokens, teacher_topk, train_draft
from minfer.speculative.pruned_draft import KNOWN_DRAFTS, init_draft_from_target, load_draft, prune_mlp, save_draft
from minfer.lab.testing import tiny_llama


def test_loss_is_the_kl_by_hand():
    draft = torch.tensor([[1.0, 0.0, -1.0]])
    teacher = torch.tensor([[0.5, 0.5, 2.0]])
    p = [math.exp(x) for x in (0.5, 0.5, 2.0)]
    q = [math.exp(x) for x in (1.0, 0.0, -1.0)]
    p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    assert distillation_loss(draft, teacher).item() == pytest.approx(kl, rel=1e-5)
    assert distillation_loss(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)


def test_loss_with_the_teachers_top_k_only():
    draft = torch.tensor([[1.0, 0.0, -1.0, 3.0]])
    values, indices = torch.tensor([[2.0, 1.0]]), torch.tensor([[3, 0]])
    p = torch.softmax(values, -1)  # the teacher renormalised over its top 2
    log_q = torch.log_softmax(draft, -1)[0, [3, 0]]
    expected = (p * (p.log() - log_q)).sum()
    assert distillation_loss(draft, values, indices).item() == pytest.approx(expected.item(), rel=1e-5)


def test_head_tokens_are_the_most_frequent_ties_to_lower_ids():
    counts = torch.tensor([0, 5, 2, 5, 0, 9])
    assert select_head_tokens(counts, 4).tolist() == [5, 1, 3, 2]
    assert select_head_tokens(counts, 5).tolist() == [5, 1, 3, 2, 0]
    with pytest.raises(ValueError, match="k must be"):
        select_head_tokens(counts, 0)


def test_prune_mlp_keeps_the_strongest_neurons_in_order():
    gate, up, down = torch.ones(4, 3), torch.ones(4, 3), torch.ones(3, 4)
    gate[1] *= 5
    gate[3] *= 3
    g, u, d = prune_mlp(gate, up, down, 2)
    assert torch.equal(g, gate[[1, 3]]) and torch.equal(u, up[[1, 3]]) and torch.equal(d, down[:, [1, 3]])


def test_draft_from_the_full_target_is_the_target():
    """All layers, no pruning, the full vocabulary as head: the draft computes the target's logits."""
    target = tiny_llama()
    draft = init_draft_from_target(target, [0, 1, 2], 48, torch.arange(64))
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(10)[None].expand(2, -1)
    assert torch.allclose(draft(ids, pos, last_only=False), target(ids, pos, last_only=False), atol=1e-5)
    assert greedy_acceptance(draft, target, ids) == 1.0
    values, indices = teacher_topk(target, ids, draft.head_token_ids, 64)
    assert distillation_loss(draft(ids, pos, last_only=False), values, indices).item() == pytest.approx(0, abs=1e-5)


def test_training_reduces_the_loss():
    target = tiny_llama()
    head = torch.arange(0, 64, 2)
    draft = init_draft_from_target(target, [0], 24, head)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (4, 16))
    values, indices = teacher_topk(target, ids, head, 8)
    losses = train_draft(draft, [(ids, values, indices)], steps=30, lr=3e-3, warmup=1)
    assert losses[-1] < 0.5 * losses[0]
    assert torch.equal(draft.embed_tokens.weight, target.embed_tokens.weight)  # the shared embedding stays frozen


def test_save_and_load_round_trip(tmp_path):
    target = tiny_llama()
    draft = init_draft_from_target(target, [0, 2], 24, torch.tensor([5, 3, 9, 1]))
    save_draft(draft, tmp_path, {"layers_from": [0, 2]})
    loaded = load_draft(str(tmp_path), target, torch.float32, "cpu")
    assert loaded.head_token_ids.tolist() == [5, 3, 9, 1]
    assert loaded.embed_tokens.weight is target.embed_tokens.weight  # shared, not copied
    for name, w in draft.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(loaded.state_dict()[name], w.to(torch.bfloat16).float()), name  # stored in bf16


def test_a_draft_in_another_dtype_leaves_the_target_alone(tmp_path):
    target = tiny_llama()
    save_draft(init_draft_from_target(target, [0], 24, torch.arange(8)), tmp_path, {"layers_from": [0]})
    loaded = load_draft(str(tmp_path), target, torch.bfloat16, "cpu")
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert target.embed_tokens.weight.dtype == torch.float32


def test_bad_names_list_the_known_drafts(tmp_path):
    target = tiny_llama()
    with pytest.raises(ValueError, match="smollm2-135m-draft-undistilled"):
        load_draft("no-such-draft", target)
    with pytest.raises(ValueError, match="hidden size"):  # the shipped draft does not fit a tiny target
        load_draft("smollm2-135m-draft", target)


@pytest.mark.parametrize("name", KNOWN_DRAFTS)
def test_shipped_drafts_load_by_name(llm, name):
    draft = load_draft(name, llm.model, torch.float32, "cpu")
    k = draft.head_token_ids.numel()
    assert draft.config.num_layers < llm.config.num_layers and k < llm.config.vocab_size
    assert draft.head_token_ids.dtype == torch.long and int(draft.head_token_ids.max()) < llm.config.vocab_size
    assert len(set(draft.head_token_ids.tolist())) == k
    ids = torch.tensor([llm.tokenizer("The capital of France is")["input_ids"]])
    logits = draft(ids, torch.arange(ids.shape[1])[None], last_only=False)
    assert logits.shape == (1, ids.shape[1], k) and torch.isfinite(logits).all()


def test_the_shipped_weights_are_package_data():
    import tomllib
    from pathlib import Path

    from minfer.speculative.pruned_draft import DRAFTS_DIR

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["minfer"]
    shipped = {p.relative_to(root / "minfer") for p in DRAFTS_DIR.rglob("*") if p.is_file()}
    assert shipped, "no draft weights under minfer/drafts"
    assert all(any(p.match(pattern) for pattern in patterns) for p in shipped), shipped


def test_the_undistilled_draft_needs_float_layers():
    target = tiny_llama()
    target.lm_head = torch.nn.Identity()  # stands in for a quantized head
    with pytest.raises(ValueError, match="unquantized"):
        init_draft_from_target(target, [0], 24, torch.arange(8))
