"""Chapter 03: slots and block tables against the engine's BlockManager, paged attention against the
kernels' PyTorch reference, online softmax against the plain softmax, the three Triton kernels of
the ladder against PyTorch, and the prefill kernel (7e) against PyTorch's scaled_dot_product_attention and
inside the engine.

The Triton kernels run compiled on CUDA, and on a CPU under Triton's interpreter, which must be
switched on (TRITON_INTERPRET=1) before triton is first imported: @triton.jit reads it when it
decorates a function, triton's own tl.max and tl.sum included. tests/conftest.py switches it on
without a GPU, before anything imports triton.
"""
import itertools
import math

import pytest
import torch

import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from minfer.engine.block_manager import BlockManager
from minfer.kernels.paged_cache import slots_for_positions, write_kv_reference
from minfer.kernels.paged_decode_attention import paged_decode_attention_reference

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ----------------------------------------------------------------- slots and block tables

@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_for_matches_the_kernels_slot_mapping(impl, block_size):
    table = [7, 2, 9, 0]
    positions = torch.arange(len(table) * block_size)
    expected = slots_for_positions(torch.tensor(table), positions, block_size).tolist()
    assert [impl.slot_for(table, p, block_size) for p in positions.tolist()] == expected


def test_slot_for_has_no_block_past_the_table(impl):
    with pytest.raises(IndexError):
        impl.slot_for([3, 1], 8, 4)


def test_grow_block_table_hands_out_blocks_like_the_block_manager(impl, gen):
    block_size = 4
    manager = BlockManager(num_blocks=12, block_size=block_size, enable_prefix_caching=False)
    free = list(manager.free_ids)
    ours, theirs = [[], [], []], [[], [], []]
    lengths = [0, 0, 0]
    for _ in range(15):  # three sequences growing by random amounts, interleaved
        seq = int(torch.randint(3, (1,), generator=gen))
        lengths[seq] += int(torch.randint(1, 4, (1,), generator=gen))
        if not manager.can_append(lengths[seq], theirs[seq]):
            break
        manager.append(theirs[seq], lengths[seq])
        impl.grow_block_table(ours[seq], free, lengths[seq], block_size)
        assert ours == theirs
        assert free == list(manager.free_ids)
        manager.check_invariants(theirs)
    assert sum(map(len, ours)) > 3  # the walk did grow the tables


def test_grow_block_table_leaves_a_long_enough_table_alone(impl):
    table, free = [5, 6], [1, 2, 3]
    impl.grow_block_table(table, free, 7, 4)
    assert table == [5, 6] and free == [1, 2, 3]
    impl.grow_block_table(table, free, 9, 4)
    assert table == [5, 6, 1] and free == [2, 3]


def test_grow_block_table_refuses_without_changing_anything(impl):
    table, free = [0], [4, 5]
    with pytest.raises(RuntimeError) as refused:
        impl.grow_block_table(table, free, 4 * 4, 4)  # needs 3 more blocks, 2 are free
    assert not isinstance(refused.value, NotImplementedError), "still a stub"
    assert table == [0] and free == [4, 5]


# ----------------------------------------------------------------- paged attention

def paged_pools(lengths_kv_heads_dim, block_size, gen, num_blocks=12):
    """Random pools (garbage everywhere) with one sequence's K/V written into shuffled blocks."""
    length, kv_heads, head_dim = lengths_kv_heads_dim
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:math.ceil(length / block_size)].tolist()
    k = torch.randn(length, kv_heads, head_dim, generator=gen)
    v = torch.randn(length, kv_heads, head_dim, generator=gen)
    write_kv_reference(k_pool, v_pool, k, v, slots_for_positions(torch.tensor(table), torch.arange(length), block_size))
    return k_pool, v_pool, table


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("length,block_size", [(1, 4), (8, 4), (13, 4), (37, 16)])
def test_paged_attention_equals_the_kernels_reference(impl, gen, heads, kv_heads, length, block_size):
    head_dim = 8
    k_pool, v_pool, table = paged_pools((length, kv_heads, head_dim), block_size, gen)
    q = torch.randn(heads, head_dim, generator=gen)
    expected = paged_decode_attention_reference(q[None], k_pool, v_pool, torch.tensor([table], dtype=torch.int32),
                                                torch.tensor([length], dtype=torch.int32))[0]
    torch.testing.assert_close(impl.paged_attention(q, k_pool, v_pool, table, length), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_uses_the_scale(impl, gen):
    k_pool, v_pool, table = paged_pools((10, 2, 8), 4, gen)
    q = torch.randn(4, 8, generator=gen)
    expected = paged_decode_attention_reference(q[None], k_pool, v_pool, torch.tensor([table], dtype=torch.int32),
                                                torch.tensor([10], dtype=torch.int32), scale=0.7)[0]
    torch.testing.assert_close(impl.paged_attention(q, k_pool, v_pool, table, 10, scale=0.7), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- online softmax

def plain_attention(q, k, v, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(k @ q * scale, dim=0) @ v


@pytest.mark.parametrize("n,chunk", [(1, 4), (16, 4), (17, 4), (50, 7), (50, 64)])
def test_online_softmax_equals_softmax(impl, gen, n, chunk):
    q, k, v = torch.randn(16, generator=gen), torch.randn(n, 16, generator=gen), torch.randn(n, 16, generator=gen)
    torch.testing.assert_close(impl.online_softmax_attention(q, k, v, chunk), plain_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_online_softmax_survives_huge_scores(impl, gen):
    # scores in the thousands: exp() overflows unless every chunk subtracts the running maximum
    q = torch.full((8,), 30.0)
    k = torch.randn(40, 8, generator=gen) * 30
    k[33] = 60.0  # the largest score comes late, after the running maximum was set by earlier chunks
    v = torch.randn(40, 8, generator=gen)
    out = impl.online_softmax_attention(q, k, v, 8, scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, plain_attention(q, k, v, 1.0), rtol=1e-5, atol=1e-5)


def test_online_softmax_never_calls_softmax(impl, gen, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("online softmax must not call softmax over the scores")

    q, k, v = torch.randn(8, generator=gen), torch.randn(20, 8, generator=gen), torch.randn(20, 8, generator=gen)
    expected = plain_attention(q, k, v)
    monkeypatch.setattr(torch, "softmax", forbidden)
    monkeypatch.setattr(torch.nn.functional, "softmax", forbidden)
    monkeypatch.setattr(torch.Tensor, "softmax", forbidden)
    torch.testing.assert_close(impl.online_softmax_attention(q, k, v, 4), expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- the Triton ladder

@pytest.fixture
def in_a_kernel(monkeypatch):
    """in_a_kernel(fn, *args, **kwargs) -> fn's result, computed with torch's softmax switched off, and
    checked to have launched a Triton kernel: the work has to happen inside one."""
    if ON_CUDA:
        from triton.runtime.jit import JITFunction as Kernel
    else:
        from triton.runtime.interpreter import InterpretedFunction as Kernel
    launch = Kernel.run

    def forbidden(*args, **kwargs):
        raise AssertionError("write the softmax inside the kernel, not with torch")

    def run(fn, *args, **kwargs):
        launched = []

        def counted(self, *launch_args, **launch_kwargs):
            launched.append(self.__name__)
            return launch(self, *launch_args, **launch_kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(Kernel, "run", counted)
            for owner in (torch, torch.nn.functional, torch.Tensor):
                patch.setattr(owner, "softmax", forbidden)
            result = fn(*args, **kwargs)
        assert launched, "no Triton kernel was launched"
        return result

    return run


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 5), (4, 16), (2, 100)])
def test_softmax_rows_triton_equals_softmax(impl, gen, in_a_kernel, rows, cols):
    x = torch.randn(rows, cols, generator=gen).to(DEVICE)
    expected = torch.exp(x - x.max(dim=1, keepdim=True).values)
    expected /= expected.sum(dim=1, keepdim=True)
    torch.testing.assert_close(in_a_kernel(impl.softmax_rows_triton, x), expected, rtol=1e-5, atol=1e-6)


def test_softmax_rows_triton_spaced_rows_and_huge_values(impl, gen, in_a_kernel):
    wide = torch.randn(3, 20, generator=gen).to(DEVICE) * 1000  # exp(1000) overflows unless the max is subtracted
    x = wide[:, 2:9]  # rows 20 floats apart: the kernel must use x.stride(0)
    expected = torch.exp(x - x.max(dim=1, keepdim=True).values)
    expected /= expected.sum(dim=1, keepdim=True)
    torch.testing.assert_close(in_a_kernel(impl.softmax_rows_triton, x), expected, rtol=1e-5, atol=1e-6)


def state_of(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The online-softmax state (m, l, acc) of rows that have seen these keys, by its definition."""
    m = scores.max(dim=1).values
    weights = torch.exp(scores - m[:, None])
    return m, weights.sum(dim=1), weights @ values


TILE_CASES = {  # (keys seen before, keys in the tile, how the tile's scores compare)
    "first-tile": (0, 5, "plain"),
    "raises-max": (4, 5, "higher"),
    "keeps-max": (6, 3, "lower"),
    "masked-keys": (4, 7, "masked"),
    "huge-jump": (4, 4, "huge"),
    "one-key": (3, 1, "plain"),
    "spaced-rows": (4, 5, "spaced"),
}


@pytest.mark.parametrize("case", list(TILE_CASES))
@pytest.mark.parametrize("head_dim", [4, 24])
def test_online_softmax_tile_triton_folds_a_tile_into_the_state(impl, gen, in_a_kernel, case, head_dim):
    seen, new, kind = TILE_CASES[case]
    rows = 3
    old_scores, old_values = torch.randn(rows, seen, generator=gen), torch.randn(seen, head_dim, generator=gen)
    scores, values = torch.randn(rows, new, generator=gen), torch.randn(new, head_dim, generator=gen)
    scores += {"plain": 0.0, "higher": 5.0, "lower": -5.0, "masked": 0.0, "huge": 1000.0, "spaced": 0.0}[kind]
    if kind == "masked":  # keys past the context: each row keeps at least one key (the tile's first)
        scores[:, 1:] = scores[:, 1:].masked_fill(torch.rand(rows, new - 1, generator=gen) < 0.5, float("-inf"))
    if seen:
        m, l, acc = state_of(old_scores, old_values)
    else:  # the empty state a kernel starts from
        m, l, acc = torch.full((rows,), float("-inf")), torch.zeros(rows), torch.zeros(rows, head_dim)
    expected = state_of(torch.cat([old_scores, scores], dim=1), torch.cat([old_values, values]))
    state = [t.to(DEVICE) for t in (m, l, acc, scores, values)]
    if kind == "spaced":  # the tile's scores as columns of a wider matrix, and acc's rows apart too
        state[2] = torch.zeros(rows, head_dim + 3, device=DEVICE)[:, :head_dim].copy_(state[2])
        state[3] = torch.zeros(rows, new + 7, device=DEVICE)[:, 2:new + 2].copy_(state[3])
    result = in_a_kernel(impl.online_softmax_tile_triton, *state)
    for name, got, want in zip(("m", "l", "acc"), result, expected):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, msg=lambda text: f"{name}: {text}")


def paged_batch(lengths: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, gen: torch.Generator):
    """q, pools full of random numbers (the engine's layout: kv_heads outermost, so the pools are
    strided views), block tables of shuffled blocks padded with block 0, and the context lengths."""
    num_blocks = sum(math.ceil(n / block_size) for n in lengths) + 3
    k_pool = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).movedim(0, 2)
    v_pool = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).movedim(0, 2)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lengths), max(math.ceil(n / block_size) for n in lengths), dtype=torch.int32)
    for seq, n in enumerate(lengths):
        blocks = [free.pop() for _ in range(math.ceil(n / block_size))]
        tables[seq, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    return q, k_pool, v_pool, tables, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 24), (9, 1, 8)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("block_size,block_n", [(4, 16), (8, 4), (16, 16)],
                         ids=["tile-spans-blocks", "tile-inside-a-block", "tile-is-a-block"])
def test_paged_attention_triton_equals_the_reference(impl, gen, in_a_kernel, heads, kv_heads, head_dim,
                                                     block_size, block_n):
    q, k_pool, v_pool, tables, lens = paged_batch([1, 9, 37], heads, kv_heads, head_dim, block_size, gen)
    expected = paged_decode_attention_reference(q, k_pool, v_pool, tables, lens)
    device_args = (t.to(DEVICE) for t in (q, k_pool, v_pool, tables, lens))
    out = in_a_kernel(impl.paged_attention_triton, *device_args, block_n=block_n)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_triton_uses_the_scale(impl, gen, in_a_kernel):
    q, k_pool, v_pool, tables, lens = paged_batch([5, 20], 4, 2, 8, 4, gen)
    expected = paged_decode_attention_reference(q, k_pool, v_pool, tables, lens, scale=0.7)
    device_args = (t.to(DEVICE) for t in (q, k_pool, v_pool, tables, lens))
    out = in_a_kernel(impl.paged_attention_triton, *device_args, scale=0.7)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_paged_attention_split_k_triton_equals_the_reference(impl, gen, in_a_kernel, num_splits):
    # lengths 1 and 9 leave some of 8 splits empty; 90 with tiles of 4 fills all 8 (slices of 12 tokens)
    q, k_pool, v_pool, tables, lens = paged_batch([1, 9, 90], 6, 2, 24, 8, gen)
    expected = paged_decode_attention_reference(q, k_pool, v_pool, tables, lens)
    device_args = (t.to(DEVICE) for t in (q, k_pool, v_pool, tables, lens))
    out = in_a_kernel(impl.paged_attention_split_k_triton, *device_args, num_splits=num_splits, block_n=4)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_triton_at_a_real_size_and_its_speed(impl, gen, in_a_kernel, record_property):
    """SmolLM2's heads (9 query, 3 KV, 64 wide) over long contexts: still equal to the reference. On CUDA the
    check also times your kernel against the gather reference and reports the speedup (check("ch03") prints it)."""
    lengths, block_size = ([2048] * 16, 16) if ON_CUDA else ([40, 17], 8)  # the interpreter is slow: small on a CPU
    q, k_pool, v_pool, tables, lens = paged_batch(lengths, 9, 3, 64, block_size, gen)
    args = [t.to(DEVICE) for t in (q, k_pool, v_pool, tables, lens)]
    expected = paged_decode_attention_reference(*args)
    out = in_a_kernel(impl.paged_attention_triton, *args)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    if ON_CUDA:
        from minfer.lab.bench.common import best_time

        yours = best_time(lambda: impl.paged_attention_triton(*args), repeats=10, device=DEVICE)
        reference = best_time(lambda: paged_decode_attention_reference(*args), repeats=10, device=DEVICE)
        record_property("speedup over the gather reference",
                        f"{reference / yours:.1f}x ({yours * 1e6:.0f} us vs {reference * 1e6:.0f} us, "
                        f"16 sequences x 2048 tokens, {torch.cuda.get_device_name(0)})")


# ----------------------------------------------------------------- 7e: FlashAttention for prefill

def prefill_batch(q_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                  block_size: int, gen: torch.Generator):
    """A prefill step's inputs: paged_batch's pools and tables for the contexts, and each sequence's new
    tokens (the last q_len of its context) packed into q, with their cu_seqlens."""
    _, k_pool, v_pool, tables, lens = paged_batch(context_lens, heads, kv_heads, head_dim, block_size, gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    return q, k_pool, v_pool, tables, cu_seqlens, lens


def sdpa_prefill(q, k_pool, v_pool, tables, cu_seqlens, lens, scale=None):
    """PyTorch's attention, one sequence at a time: its K/V gathered in order, its KV heads repeated for
    GQA, and the causal mask aligned to the end of the context (the new tokens are its last q_len)."""
    group = q.shape[1] // k_pool.shape[2]
    out = torch.empty_like(q)
    for seq, length in enumerate(lens.tolist()):
        start, end = cu_seqlens[seq].item(), cu_seqlens[seq + 1].item()
        slots = slots_for_positions(tables[seq], torch.arange(length), k_pool.shape[1])
        k, v = (pool.flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(group, dim=0) for pool in (k_pool, v_pool))
        out[start:end] = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k, v, scale=scale,
                                                        attn_mask=causal_lower_right(end - start, length)).transpose(0, 1)
    return out


PREFILL_CASES = {  # (new tokens per sequence, context lengths, heads, KV heads, head_dim, block size)
    "cached-prefix": ([7, 20], [32, 45], 4, 4, 16, 4),
    "whole-prompts": ([17, 33], [17, 33], 6, 2, 24, 8),
    "ragged-mixed": ([1, 40, 9, 3], [1, 55, 9, 20], 3, 1, 8, 16),
}


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_flash_prefill_triton_equals_sdpa(impl, gen, in_a_kernel, case):
    # every context but the 32-token one ends inside its last block (a partial last block); tiles of 16
    # queries leave the 33- and 40-token chunks a last tile of 1 and 8 rows
    batch = prefill_batch(*PREFILL_CASES[case], gen)
    expected = sdpa_prefill(*batch)
    out = in_a_kernel(impl.flash_prefill_triton, *(t.to(DEVICE) for t in batch))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_flash_prefill_triton_other_tiles_and_the_scale(impl, gen, in_a_kernel):
    batch = prefill_batch([12, 37], [50, 37], 4, 2, 16, 4, gen)
    expected = sdpa_prefill(*batch, scale=0.3)
    out = in_a_kernel(impl.flash_prefill_triton, *(t.to(DEVICE) for t in batch), scale=0.3, block_m=32, block_n=32)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_flash_prefill_triton_inside_the_engine(impl, random_tiny_dir, monkeypatch):
    """The engine's Triton path with your kernel for every prefill chunk gives the tokens and log-probabilities
    of its own kernel. Chunks of at most 16 tokens split the longer prompts: later chunks read a cached prefix."""
    from minfer import LLM, SamplingParams
    from minfer.kernels import paged_prefill_attention as prefill_module

    rng = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=rng).tolist()} for n in (5, 23, 38)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    chunks = []

    def yours(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens, scale=None, *, k_scales=None,
              v_scales=None, max_q_len=None):
        assert k_scales is None and v_scales is None  # float pools
        chunks.extend(zip(cu_seqlens_q.diff().tolist(), context_lens.tolist()))
        return impl.flash_prefill_triton(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens, scale)

    results = []
    for kernel in (prefill_module.paged_prefill_attention, yours):
        llm = LLM(random_tiny_dir, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
                  num_gpu_blocks_override=40)
        llm.engine.runner.use_kernels = True
        with monkeypatch.context() as patch:
            patch.setattr(prefill_module, "paged_prefill_attention", kernel)
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outputs],
                        torch.tensor([o.outputs[0].cumulative_logprob for o in outputs])))
    (engine_tokens, engine_logprobs), (your_tokens, your_logprobs) = results
    assert any(q_len < length for q_len, length in chunks), f"no chunk read a cached prefix: {chunks}"
    # The random weights' greedy tokens hardly depend on attention; their log-probabilities do (as in section 7d).
    assert your_tokens == engine_tokens
    torch.testing.assert_close(your_logprobs, engine_logprobs, rtol=0, atol=1e-4)
