"""dtype="auto" and the formats a GPU can run, by its compute capability: checked with a stand-in GPU.

torch is told it has a CUDA device of a given capability (torch.cuda.is_available, get_device_capability and
get_device_name replaced), so the choices and refusals of `minfer.formats.hardware` run on a CPU-only machine:
bfloat16 from sm_80, float16 below (a T4 is sm_75), fp8 (e4m3) KV from sm_89, float32 and every format on a CPU.
"""
from types import SimpleNamespace

import pytest
import torch

from minfer.config import EngineConfig, ModelConfig
from minfer.engine.paged_kv import KVPool
from minfer.formats.kv import FP8_DTYPE
from minfer.kernels.paged_cache import check_scales

GPUS = {(7, 5): "Tesla T4", (8, 0): "NVIDIA A100-SXM4-40GB", (8, 6): "NVIDIA GeForce RTX 3090",
        (8, 9): "NVIDIA L4", (9, 0): "NVIDIA H100 80GB HBM3"}


@pytest.fixture
def gpu(monkeypatch):
    """gpu((major, minor)): from then on torch sees one CUDA device of that capability."""
    def install(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPUS[capability])
        # torch answers True here on sm_75 too (it emulates bfloat16): the choice must not follow it
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return install


@pytest.mark.parametrize("capability, dtype", [((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                               ((8, 6), torch.bfloat16), ((8, 9), torch.bfloat16),
                                               ((9, 0), torch.bfloat16)])
def test_auto_dtype_follows_the_capability(gpu, capability, dtype):
    gpu(capability)
    config = EngineConfig(device="auto")
    assert config.device.type == "cuda" and config.dtype == dtype


def test_auto_dtype_is_float32_on_a_cpu(gpu):
    gpu((9, 0))
    assert EngineConfig(device="cpu").dtype == torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", torch.bfloat16])
def test_bfloat16_is_refused_below_sm80_naming_the_gpu_and_the_way_out(gpu, dtype):
    gpu((7, 5))
    with pytest.raises(ValueError, match=r"bfloat16 needs .*8\.0.*Tesla T4 \(sm_75\).*dtype='float16'"):
        EngineConfig(device="cuda", dtype=dtype)
    assert EngineConfig(device="cuda", dtype="float16").dtype == torch.float16
    assert EngineConfig(device="cpu", dtype=dtype).dtype == torch.bfloat16  # a CPU runs it (in software)
    gpu((8, 0))
    assert EngineConfig(device="cuda", dtype=dtype).dtype == torch.bfloat16


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (8, 6)])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_fp8_kv_is_refused_below_sm89_naming_the_gpu_and_int8(gpu, capability, kv_cache_dtype):
    gpu(capability)
    name = rf"{GPUS[capability]} \(sm_{capability[0]}{capability[1]}\)"
    with pytest.raises(ValueError, match=rf"kv_cache_dtype='fp8' \(e4m3\) needs .*8\.9.*{name}.*kv_cache_dtype='int8'"):
        EngineConfig(device="cuda", dtype="float16", kv_cache_dtype=kv_cache_dtype)
    assert EngineConfig(device="cuda", dtype="float16", kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert EngineConfig(device="cpu", kv_cache_dtype=kv_cache_dtype).kv_cache_dtype == "fp8"  # the CPU: as before


@pytest.mark.parametrize("capability", [(8, 9), (9, 0)])
def test_fp8_kv_is_accepted_from_sm89(gpu, capability):
    gpu(capability)
    assert EngineConfig(device="cuda", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_an_fp8_pool_is_refused_below_sm89_before_anything_is_allocated_or_compiled(gpu):
    gpu((8, 6))
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=64,
                         tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"sm_86.*kv_cache_dtype='int8'"):
        KVPool(config, num_blocks=2, block_size=4, dtype=torch.float16, device="cuda", kv_cache_dtype="fp8")
    # the kernels' own check, for pools made by hand: a stand-in for a CUDA tensor (this torch has no CUDA)
    pool = SimpleNamespace(dtype=FP8_DTYPE, device=torch.device("cuda"), shape=(2, 4, 1, 8))
    with pytest.raises(ValueError, match=r"an fp8 KV pool \(e4m3\) needs .*sm_86"):
        check_scales(pool, torch.ones(1), torch.ones(1))
