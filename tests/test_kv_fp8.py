"""The fp8 (e4m3) KV cache: the format's error bound, its scales, the pool, attention, the engine, the kernels.

The format is checked against float8_e4m3fn's own grid (3 mantissa bits: every normal number comes
back within 2^-4 of itself), attention over an fp8 pool against attention over the float pool, an
fp8-KV engine against the float one on a tiny model, and the Triton kernels in a fresh process
under TRITON_INTERPRET=1 (the interpreter runs e4m3 conversions) against the fp8 references and
the unquantized ones.
"""
import math

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.config import EngineConfig
from minfer.engine.kv_calibration import kv_ranges
from minfer.engine.paged_kv import KVPool, PagedStep, SequenceSlice
from minfer.formats.kv import FP8_HEADROOM, FP8_MAX, dequantize_kv, fp8_scale, kv_vector_bytes, quantize_kv_fp8
from test_kv_int8 import run_interpreted  # tests/ is on sys.path (no __init__.py): pytest puts it there


# --- the format ------------------------------------------------------------------------------------

def test_round_trip_is_within_the_e4m3_step():
    gen = torch.Generator().manual_seed(0)
    heads = torch.tensor([0.01, 1.0, 300.0])  # heads of very different magnitudes
    x = torch.randn(200, 3, 64, generator=gen) * heads[:, None]
    scale = fp8_scale(x.abs().amax(dim=(0, 2)))
    q = quantize_kv_fp8(x, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert torch.allclose(q.float().abs().amax(dim=(0, 2)), torch.full((3,), FP8_MAX / FP8_HEADROOM), rtol=1 / 16)
    back = dequantize_kv(q, scale.expand(x.shape[:-1]))
    scaled = x / scale[:, None]
    normal = scaled.abs() >= 2**-6  # e4m3's smallest normal number; below it the step is a fixed 2^-9
    error = (back - x).abs()
    assert (error[normal] <= x.abs()[normal] * 2**-4 * (1 + 1e-6)).all()  # half of a 2^-3 step, relative
    assert (error[~normal] <= (2**-10 * scale[:, None]).expand_as(x)[~normal] * (1 + 1e-6)).all()
    assert normal.float().mean() > 0.99
    relative = (error.norm(dim=-1) / x.norm(dim=-1)).max()
    assert relative < 0.06  # per vector; measured 0.035 on these gaussian vectors


def test_saturates_instead_of_overflowing():
    scale = torch.ones(2)
    x = torch.tensor([[[1e4, -1e4, 447.0, 0.0]], [[2e3, 1.0, -0.5, 3.0]]]).transpose(0, 1)  # [1, 2 heads, 4]
    q = quantize_kv_fp8(x, scale).float()
    assert torch.isfinite(q).all()
    assert q[0, 0].tolist() == [448.0, -448.0, 448.0, 0.0] and q[0, 1].tolist() == [448.0, 1.0, -0.5, 3.0]


def test_scale_is_per_head_with_headroom():
    amax = torch.tensor([[2.0, 0.0], [448.0, 10.0]])
    assert torch.equal(fp8_scale(amax), torch.tensor([[2.0 * FP8_HEADROOM / FP8_MAX, 1.0],
                                                      [FP8_HEADROOM, 10.0 * FP8_HEADROOM / FP8_MAX]]))


def test_bytes_per_vector_is_head_dim():
    assert [kv_vector_bytes(64, torch.bfloat16, kind) for kind in ("auto", "int8", "fp8", "fp8_e4m3")] == [128, 68, 64, 64]


def test_bad_kv_cache_dtype_names_the_allowed_ones(tmp_path):
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    allowed = r"kv_cache_dtype must be 'auto' \(the model's dtype\), 'int8' or 'fp8' \(= 'fp8_e4m3'\)"
    with pytest.raises(ValueError, match=allowed + r", got 'fp8_e5m2': e5m2 is not implemented"):
        LLM(str(tmp_path / "never_loaded"), kv_cache_dtype="fp8_e5m2")  # checked before the model loads
    for bad in ("FP8", "float8", "e4m3", None):
        with pytest.raises(ValueError, match=allowed):
            EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match=allowed):
        kv_vector_bytes(64, torch.float32, "fp8_e5m2")


# --- the pool and attention over it ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(random_tiny_dir):
    return LLM(random_tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=32, block_size=4)


def prefill_logits(model, pool: KVPool, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of token_ids, in one prefill through `pool`, then one decode step of the last token
    again (so the decode path reads the pool too): [len + 1, vocab]."""
    n = len(token_ids)
    blocks = list(range(math.ceil((n + 1) / pool.block_size)))
    step = PagedStep(pool, [SequenceSlice(0, n, n, blocks)], torch.arange(n))
    prefill = model(torch.tensor([token_ids]), torch.arange(n)[None], step, last_only=False)[0]
    step = PagedStep(pool, [SequenceSlice(0, 1, n + 1, blocks)], torch.tensor([n]))
    decode = model(torch.tensor([token_ids[-1:]]), torch.tensor([[n]]), step)[0]
    return torch.cat([prefill, decode])


def test_pool_stores_fp8_and_attention_stays_close_to_float(tiny):
    config, ids = tiny.config, list(range(5, 45))
    pool = KVPool(config, 16, 4, torch.float32, "cpu", "fp8")
    assert pool.k.dtype == torch.float8_e4m3fn and pool.k_scale.shape == (config.num_layers, config.num_kv_heads)
    assert pool.nbytes == 16 * 4 * config.kv_bytes_per_token(torch.float32, "fp8")
    pool.calibrate_fp8(*kv_ranges(tiny.model, ids))
    with pytest.raises(ValueError, match="calibrate_fp8 is for an fp8 pool"):
        KVPool(config, 2, 4, torch.float32, "cpu").calibrate_fp8(pool.k_scale, pool.v_scale)
    exact = prefill_logits(tiny.model, KVPool(config, 16, 4, torch.float32, "cpu"), ids)
    fp8 = prefill_logits(tiny.model, pool, ids)
    log_p, log_q = exact.log_softmax(-1), fp8.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    print("max |dlogit|", (exact - fp8).abs().max().item(), "mean KL", kl.mean().item())
    assert (exact - fp8).abs().max() < 0.05  # measured 0.011
    assert kl.max() < 1e-3  # measured mean 1.5e-6
    assert not torch.equal(exact, fp8)  # the pool did round
    # the scales: the calibration pass's largest |k|, |v| per (layer, head), with the headroom
    k, v = kv_ranges(tiny.model, ids)
    assert torch.allclose(pool.k_scale, k * FP8_HEADROOM / FP8_MAX) and torch.allclose(pool.v_scale, v * FP8_HEADROOM / FP8_MAX)


# --- the engine -----------------------------------------------------------------------------------

def test_engine_greedy_output_close_to_float(tiny, random_tiny_dir):
    fp8 = LLM(random_tiny_dir, dtype="float32", device="cpu", num_gpu_blocks_override=32, block_size=4,
              kv_cache_dtype="fp8_e4m3")
    assert fp8.engine.config.kv_cache_dtype == "fp8" and (fp8.engine.runner.pool.k_scale != 1).all()  # calibrated
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in tiny.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    agreed = [next((i for i, (a, b) in enumerate(zip(r, q)) if a != b), len(r)) for r, q in zip(reference, got)]
    print("tokens agreed before the first difference:", agreed)
    assert sum(agreed) >= 0.75 * 4 * 12  # measured: all 48
    solo = [fp8.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert solo == got  # the static scales make a sequence's cache independent of its batch
    assert fp8.engine.blocks.num_free_blocks == 32


# --- the Triton kernels, under the interpreter ---------------------------------------------------

KERNELS = """
import torch
from minfer.formats.kv import fp8_scale
from minfer.kernels.paged_cache import slots_for_positions, write_kv, write_kv_reference
from minfer.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference
from minfer.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_reference

device = "cuda" if torch.cuda.is_available() else "cpu"
tight = 1e-4  # float32 tl.dot is exact on CUDA too (input_precision="ieee")
worst = 0.0
for block_size, (num_heads, num_kv_heads, head_dim) in [(4, (9, 3, 24))]:  # GQA, a head_dim not a power of two
    gen = torch.Generator().manual_seed(block_size)
    lengths = [1, 7, 23, block_size]
    blocks = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(blocks) + 2
    tables = torch.full((len(lengths), max(blocks) + 1), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for s, count in enumerate(blocks):
        tables[s, :count] = torch.tensor([free.pop() for _ in range(count)])
    slots = torch.cat([slots_for_positions(tables[s], torch.arange(n), block_size) for s, n in enumerate(lengths)])
    magnitude = torch.tensor([0.05, 3.0, 40.0])[:num_kv_heads, None]  # heads of different ranges
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen) * magnitude
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen) * magnitude
    scales = [fp8_scale(t.abs().amax(dim=(0, 2))) for t in (k, v)]  # calibrated on these very tokens
    k[5, 0, 0] = 1e4  # far beyond the calibrated range: saturates, never inf or NaN
    slots = torch.cat([slots, torch.tensor([-1])])  # a padding token, written nowhere
    k, v = torch.cat([k, k[:1]]), torch.cat([v, v[:1]])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kernel_pools = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device) for _ in range(2)]
    write_kv(*kernel_pools, k.to(device), v.to(device), slots.int().to(device), *[s.to(device) for s in scales])
    kp, vp = [t.cpu() for t in kernel_pools]
    reference = [torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(2)]
    write_kv_reference(*reference, k, v, slots, *scales)
    for got, want in zip((kp, vp), reference):  # the same e4m3 codes (CUDA's fast division may move a tie a step)
        assert torch.isfinite(got.float()).all()
        steps = (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()
        assert steps.max() <= (0 if device == "cpu" else 1) and (steps > 0).float().mean() < 1e-3, steps.max()
    exact_k = torch.zeros(shape); exact_v = torch.zeros(shape)
    k[5, 0, 0] = scales[0][0] * 448  # the saturated value, as the exact reference should see it
    write_kv_reference(exact_k, exact_v, k, v, slots)

    lens = torch.tensor(lengths, dtype=torch.int32)
    kw = dict(k_scales=scales[0].to(device), v_scales=scales[1].to(device))
    # queries scaled against their KV head's keys: scores of order 1, as a trained model's are
    per_query_head = (1 / magnitude).repeat_interleave(num_heads // num_kv_heads, dim=0)[:, 0][:, None]
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen) * per_query_head
    got = paged_decode_attention(q.to(device), *kernel_pools, tables.to(device), lens.to(device), block_n=16, **kw).cpu()
    want = paged_decode_attention_reference(q, kp, vp, tables, lens, k_scales=scales[0], v_scales=scales[1])
    exact = paged_decode_attention_reference(q, exact_k, exact_v, tables, lens)
    torch.testing.assert_close(got, want, atol=tight * 40, rtol=tight)
    relative = ((got - exact).abs().amax(dim=(0, 2)) / exact.abs().amax(dim=(0, 2))).max().item()
    assert relative < 0.15, relative  # measured 0.052
    worst = max(worst, relative)

    q_lens = [1, 4, 23, 3]
    cu = torch.tensor([0] + q_lens).cumsum(0).int()
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen) * per_query_head
    got = paged_prefill_attention(q.to(device), *kernel_pools, tables.to(device), cu.to(device), lens.to(device),
                                  block_m=16, block_n=16, **kw).cpu()
    want = paged_prefill_attention_reference(q, kp, vp, tables, cu, lens, k_scales=scales[0], v_scales=scales[1])
    exact = paged_prefill_attention_reference(q, exact_k, exact_v, tables, cu, lens)
    torch.testing.assert_close(got, want, atol=tight * 40, rtol=tight)
    relative = ((got - exact).abs().amax(dim=(0, 2)) / exact.abs().amax(dim=(0, 2))).max().item()
    assert relative < 0.15, relative  # measured 0.052
    worst = max(worst, relative)
print(f"fp8 kernels == fp8 references; largest difference from the unquantized reference, relative per head: {worst:.4f}")
"""


@pytest.mark.slow  # about 17 s: the interpreter
def test_fp8_kernels_match_their_references():
    out = run_interpreted(KERNELS)
    print(out)
    assert "fp8 kernels == fp8 references" in out
