"""The paged-cache Triton kernels against their PyTorch references, and the references against the model's attention.

On a CUDA machine the kernels run compiled. Without one they run under Triton's interpreter, which
executes every program instance with numpy: slow, so the shapes here are small, but it runs the
kernels' own code (masks, block-table gathers, online softmax) and catches the same mistakes.
tests/conftest.py switches the interpreter on before triton is first imported.
Tolerances: float32 1e-4, on CUDA too: every tl.dot asks for input_precision="ieee" (checked below), without
which a GPU rounds float32 operands to TF32 and misses by about 1e-3, a slip the interpreter cannot show;
float16 5e-3; bfloat16 2e-2 (CUDA only).
"""
import ast
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch

from minfer.kernels import paged_cache, paged_decode_attention as decode_module
from minfer.kernels.paged_cache import gather_kv, slots_for_positions, use_triton, write_kv, write_kv_reference
from minfer.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from minfer.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_reference
from minfer.layers.attention import attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (num_heads, num_kv_heads, head_dim): GQA groups of 1, 3 and 9; 24 is not a power of two, so the
# kernels' padded head_dim lanes must be masked correctly.
HEAD_SHAPES = [(9, 9, 16), (9, 3, 32), (9, 1, 24)]
BLOCK_SIZES = [4, 8, 16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def paged_cache_of(contexts: list[torch.Tensor], block_size: int, gen: torch.Generator, spare_blocks: int = 3):
    """Pools holding each sequence's K or V [len, kv_heads, head_dim] in shuffled blocks, and the block tables.

    Blocks nobody owns, and the unused tail of each sequence's last block, hold random garbage:
    a kernel that reads a wrong slot gets a wrong answer, not a lucky zero.
    """
    num_kv_heads, head_dim = contexts[0][0].shape[1:]
    blocks_needed = [math.ceil(len(k) / block_size) for k, _ in contexts]
    num_blocks = sum(blocks_needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    dtype = contexts[0][0].dtype
    k_pool = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v_pool = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    # One -1 column more than the longest sequence needs: the padding is always there to be (not) read.
    block_tables = torch.full((len(contexts), max(blocks_needed) + 1), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for seq, ((k, v), count) in enumerate(zip(contexts, blocks_needed)):
        block_tables[seq, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
        slots = slots_for_positions(block_tables[seq], torch.arange(len(k)), block_size)
        write_kv_reference(k_pool, v_pool, k, v, slots.to(DEVICE))
    context_lens = torch.tensor([len(k) for k, _ in contexts], dtype=torch.int32)
    return k_pool, v_pool, block_tables.to(DEVICE), context_lens.to(DEVICE)


def random_contexts(lengths: list[int], num_kv_heads: int, head_dim: int, gen: torch.Generator,
                    dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype),
             torch.randn(n, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)) for n in lengths]


# --- the layout ------------------------------------------------------------------------------------

def tl_dots_without_precision(source: str) -> list[int]:
    """Line numbers of the `tl.dot(...)` calls in source that do not say their input_precision."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "dot"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"
            and "input_precision" not in {k.arg for k in node.keywords}]


def test_every_tl_dot_states_its_precision():
    """On a GPU a float32 tl.dot rounds its operands to TF32 unless told otherwise; the interpreter computes in
    float32 either way, so no kernel test on a CPU can notice. Every kernel's tl.dot says input_precision."""
    kernels = sorted((Path(__file__).resolve().parents[1] / "minfer" / "kernels").glob("*.py"))
    assert tl_dots_without_precision("acc += tl.dot(a, b)\nacc += tl.dot(a, b, input_precision='ieee')") == [1]
    missing = {k.name: lines for k in kernels if (lines := tl_dots_without_precision(k.read_text()))}
    assert not missing, f"tl.dot without input_precision (TF32 on a GPU) at {missing}"


def test_slots_follow_the_block_table():
    block_table = torch.tensor([5, 2, -1], dtype=torch.int32)
    slots = slots_for_positions(block_table, torch.tensor([0, 3, 4, 6]), block_size=4)
    assert slots.tolist() == [20, 23, 8, 10]  # block 5 offsets 0 and 3, then block 2 offsets 0 and 2


def test_gather_returns_what_was_written():
    gen = torch.Generator().manual_seed(0)
    contexts = random_contexts([5, 8, 1], num_kv_heads=2, head_dim=4, gen=gen)
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(contexts, block_size=4, gen=gen)
    for seq, (k, v) in enumerate(contexts):
        assert torch.equal(gather_kv(k_pool, block_tables[seq], int(context_lens[seq])), k)
        assert torch.equal(gather_kv(v_pool, block_tables[seq], int(context_lens[seq])), v)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_write_kv_matches_reference(block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 5, 3, 24
    k_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    # New K and V as slices of one fused projection output: strided, as a model produces them.
    fused = torch.randn(7, 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    k_new, v_new = fused[:, :num_kv_heads], fused[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7].to(torch.int32)
    slots[[1, 4]] = -1  # padding tokens: not written anywhere
    slots = slots.to(DEVICE)

    before = k_pool.clone()
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    write_kv_reference(expected_k, expected_v, k_new, v_new, slots)
    write_kv(k_pool, v_pool, k_new, v_new, slots)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)

    written = slots >= 0
    assert torch.equal(k_pool.flatten(0, 1)[slots[written].long()], k_new[written])
    changed = (k_pool != before).flatten(0, 1).flatten(1).any(dim=1).nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(slots[written].tolist())  # the padding tokens went nowhere


# --- the references against the model's attention ------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("length", [1, 8, 13])
def test_decode_reference_is_attention(heads, kv_heads, head_dim, length):
    gen = torch.Generator().manual_seed(length)
    contexts = random_contexts([length], kv_heads, head_dim, gen)
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(contexts, block_size=4, gen=gen)
    q = torch.randn(1, heads, head_dim, generator=gen).to(DEVICE)
    k, v = (t.permute(1, 0, 2)[None] for t in contexts[0])  # contiguous [1, kv_heads, len, head_dim]
    expected = attention_reference(q[:, :, None], k, v, None)[:, :, 0]
    torch.testing.assert_close(paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens),
                               expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("q_len,length", [(1, 1), (6, 6), (5, 13)])
def test_prefill_reference_is_attention(heads, kv_heads, head_dim, q_len, length):
    gen = torch.Generator().manual_seed(length)
    contexts = random_contexts([length], kv_heads, head_dim, gen)
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(contexts, block_size=4, gen=gen)
    q = torch.randn(q_len, heads, head_dim, generator=gen).to(DEVICE)
    cu_seqlens_q = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    k, v = (t.permute(1, 0, 2)[None] for t in contexts[0])
    # mask=None: causal, with the queries being the last q_len keys, the prefill contract exactly.
    expected = attention_reference(q.permute(1, 0, 2)[None], k, v, None)[0].permute(1, 0, 2)
    actual = paged_prefill_attention_reference(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


# --- the kernels against the references -----------------------------------------------------------

def test_kernels_run_as_triton_here():
    """Guards the comparisons below: they must exercise Triton, not the reference fallback."""
    assert use_triton(torch.empty(1, device=DEVICE))
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction
        assert isinstance(decode_module._paged_decode_kernel, InterpretedFunction)
        assert isinstance(paged_cache._write_kv_kernel, InterpretedFunction)


@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_kernel_matches_reference(heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(block_size * 100 + kv_heads)
    # One token, a whole block, one past two blocks, and a long odd one spanning three tiles of 16.
    lengths = [1, block_size, 2 * block_size + 1, 37]
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(random_contexts(lengths, kv_heads, head_dim, gen), block_size, gen)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(DEVICE)
    expected = paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens)
    assert_close(paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, block_n=16), expected)


def test_decode_kernel_default_tiles_and_scale():
    gen = torch.Generator().manual_seed(1)
    lengths = [150, 64, 3]  # past two tiles of the default 64 tokens, exactly one, and a partial one
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(random_contexts(lengths, 2, 32, gen), 16, gen)
    q = torch.randn(3, 4, 32, generator=gen).to(DEVICE)
    expected = paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale=0.3)
    assert_close(paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale=0.3), expected)


HALF_DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])  # the interpreter mishandles bfloat16 math


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_decode_kernel_half_precision(dtype):
    gen = torch.Generator().manual_seed(2)
    contexts = random_contexts([21, 5], 3, 32, gen, dtype)
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(contexts, 8, gen)
    q = torch.randn(2, 9, 32, generator=gen).to(DEVICE, dtype)
    expected = paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens)
    assert_close(paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, block_n=16), expected)


@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_SHAPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("cached_prefix", [False, True], ids=["whole_prompt", "after_cached_prefix"])
def test_prefill_kernel_matches_reference(heads, kv_heads, head_dim, block_size, cached_prefix):
    gen = torch.Generator().manual_seed(block_size * 10 + kv_heads + cached_prefix)
    if cached_prefix:  # chunks of 1, a block, and 19 (two query tiles of 16) after cached tokens
        q_lens, lengths = [1, block_size, 19], [block_size + 1, 2 * block_size + 3, 37]
    else:  # whole prompts: one token, an odd length over two query tiles, a block boundary
        q_lens = lengths = [1, 19, 2 * block_size]
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(random_contexts(lengths, kv_heads, head_dim, gen), block_size, gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(DEVICE)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    expected = paged_prefill_attention_reference(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens)
    actual = paged_prefill_attention(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens, block_m=16, block_n=16)
    assert_close(actual, expected)


def test_prefill_kernel_default_tiles_and_half_precision():
    gen = torch.Generator().manual_seed(3)
    q_lens, lengths = [70, 9], [90, 9]
    contexts = random_contexts(lengths, 1, 16, gen, torch.float16)
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(contexts, 16, gen)
    q = torch.randn(sum(q_lens), 3, 16, generator=gen).to(DEVICE, torch.float16)
    cu_seqlens_q = torch.tensor([0, 70, 79], dtype=torch.int32, device=DEVICE)
    expected = paged_prefill_attention_reference(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens)
    assert_close(paged_prefill_attention(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens), expected)
    # the engine passes the longest chunk from the host (no sync): the same result
    assert_close(paged_prefill_attention(q, k_pool, v_pool, block_tables, cu_seqlens_q, context_lens, max_q_len=70),
                 expected)


def test_one_engine_step_prefill_then_decode():
    """The engine's order of work: write the new tokens' K/V, then attend; equal to contiguous attention."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim, block_size, prompt = 4, 2, 16, 4, 10
    k_all = torch.randn(prompt + 1, kv_heads, head_dim, generator=gen).to(DEVICE)
    v_all = torch.randn(prompt + 1, kv_heads, head_dim, generator=gen).to(DEVICE)
    q_all = torch.randn(prompt + 1, heads, head_dim, generator=gen).to(DEVICE)
    k_pool = torch.zeros(6, block_size, kv_heads, head_dim, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    block_tables = torch.tensor([[4, 0, 2, -1]], dtype=torch.int32, device=DEVICE)
    slots = slots_for_positions(block_tables[0], torch.arange(prompt + 1, device=DEVICE), block_size)

    write_kv(k_pool, v_pool, k_all[:prompt], v_all[:prompt], slots[:prompt])
    prefill = paged_prefill_attention(q_all[:prompt], k_pool, v_pool, block_tables,
                                      torch.tensor([0, prompt], dtype=torch.int32, device=DEVICE),
                                      torch.tensor([prompt], dtype=torch.int32, device=DEVICE), block_m=16, block_n=16)
    write_kv(k_pool, v_pool, k_all[prompt:], v_all[prompt:], slots[prompt:])
    decode = paged_decode_attention(q_all[prompt:], k_pool, v_pool, block_tables,
                                    torch.tensor([prompt + 1], dtype=torch.int32, device=DEVICE), block_n=16)

    contiguous = attention_reference(q_all.permute(1, 0, 2)[None], k_all.permute(1, 0, 2)[None],
                                     v_all.permute(1, 0, 2)[None], None)[0].permute(1, 0, 2)
    assert_close(torch.cat([prefill, decode]), contiguous)


# --- dispatch and input checks ---------------------------------------------------------------------

@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA tensors always take the Triton path")
def test_without_interpreter_cpu_tensors_use_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(decode_module, "_paged_decode_kernel", None)  # launching it would raise
    gen = torch.Generator().manual_seed(5)
    k_pool, v_pool, block_tables, context_lens = paged_cache_of(random_contexts([6], 1, 16, gen), 4, gen)
    q = torch.randn(1, 2, 16, generator=gen)
    assert not use_triton(q)
    assert torch.equal(paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens),
                       paged_decode_attention_reference(q, k_pool, v_pool, block_tables, context_lens))


def test_bad_inputs_are_named():
    k_pool = torch.zeros(2, 4, 2, 16, device=DEVICE)
    block_tables = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads=2"):
        paged_decode_attention(torch.zeros(1, 3, 16, device=DEVICE), k_pool, k_pool, block_tables, lens)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(torch.zeros(1, 2, 16, device=DEVICE), k_pool, k_pool, block_tables.long(), lens)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        paged_decode_attention(torch.zeros(1, 2, 16, device=DEVICE), k_pool, k_pool, block_tables, lens, block_n=24)
    with pytest.raises(ValueError, match="q_len <= context_len"):
        paged_prefill_attention(torch.zeros(6, 2, 16, device=DEVICE), k_pool, k_pool, block_tables,
                                torch.tensor([0, 6], dtype=torch.int32, device=DEVICE), lens)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the benchmark really runs")
def test_benchmark_says_it_needs_cuda(capsys, monkeypatch):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--matmul-shapes", "llama", "--group-sizes", "64", "128"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_info.value.code == 0
    assert "needs CUDA" in capsys.readouterr().out

