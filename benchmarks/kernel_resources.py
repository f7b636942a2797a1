"""Every Triton kernel of minfer/kernels compiled for real GPUs, on any machine: shared memory and registers.

    python benchmarks/kernel_resources.py                    # a markdown table, sm_75 to sm_90
    python benchmarks/kernel_resources.py --jobs 2 --json resources.json
    python benchmarks/kernel_resources.py --full             # every combination, not just every value

Without a GPU the tests run the kernels under Triton's interpreter (TRITON_INTERPRET=1), which
executes them with numpy and never compiles them. It lets through what the GPU compiler rejects
(a ``tl.dot`` with an inner side under 16), and it knows nothing of shared memory or registers.
This script compiles instead, for GPUs that are not here:

    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 80, 32))

runs Triton's whole pipeline (Triton IR, GPU IR, LLVM IR, PTX) and ends with the ``ptxas`` that
ships inside the triton wheel, which writes a cubin: no driver, no GPU. From each kernel it
reports the shared memory its launch would request (``metadata.shared``, what Triton compares
with the device's limit before a launch) and, from the report of ``ptxas -v``, its registers per
thread and the bytes it spills to local memory when registers run out. Limits checked: shared
memory per block at most 64 KiB on sm_75 (T4), 163 KiB on sm_80 (A100), 99 KiB on sm_86 and sm_89 (RTX 30xx
and 40xx, L4) and 227 KiB on sm_90 (H100, H200); at most 255
registers per thread; and no spills beyond a register or two (not an error on a GPU, but slow).

Which variants: the ones the engine launches. Rather than restate how each wrapper chooses its
constexprs, the script calls the wrappers themselves, with the engine's defaults, on small CPU
tensors of the dtypes and shapes in question, with the kernel swapped for a recorder: what the
recorder receives is exactly what the wrapper would launch (arguments and constexprs), and that
is compiled, specialized the way a launch specializes it (pointers and integers divisible by 16,
integers equal to 1, None). By default every value of every axis is covered, crossed with the
others where that changes the compiled code (see ``variants``); ``--full`` takes the whole
product. tests/test_kernel_compile.py runs this script and checks its findings.
"""
from __future__ import annotations

import os

# @triton.jit reads TRITON_INTERPRET when it decorates a function: unset it before triton is
# imported, or every kernel (and triton's own tl.max, tl.sum...) becomes an interpreted function.
os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

from minfer.formats.weights import pack_int4, quantize_int4_groupwise, quantize_int8_per_channel  # noqa: E402
from minfer.kernels import fused_moe, paged_cache, paged_decode_attention, paged_prefill_attention, quant_matmul  # noqa: E402

# Triton 3.9 warns once per process that its fp-fusion default will change; the kernels compile
# with the current default, as they would on a GPU.
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
# Triton's ptxas step runs with -v; this makes it print the report (registers, spills) instead of dropping it.
triton.knobs.nvidia.dump_ptxas_log = True

ARCHS = {75: "sm_75 (T4, RTX 20xx)", 80: "sm_80 (A100)", 86: "sm_86 (RTX 30xx, A10)", 89: "sm_89 (RTX 40xx, L4)",
         90: "sm_90 (H100, H200)"}
# bytes of shared memory one block may opt in to
SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
FULL_ARCHS = (80, 90)  # every variant (``variants``); the others, what the engine launches by default (``default_variants``)
MAX_REGISTERS = 255  # per thread, on every NVIDIA GPU since Kepler
# A register or two spilled (4 B: Triton 3.6's int8-KV prefill tiles on sm_80, seen on the first GPU run) is one
# L1-cached store and load per tile, nothing measurable; more means tiles too big for the register file.
TOLERATED_SPILL_BYTES = 8

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KV_FORMATS = ("auto", "int8")  # the pools in the model's dtype, or int8 with float32 scales
# fp8 (e4m3) pools: compiled at BASE, and from sm_89 on only: Triton refuses e4m3 (its fp8e4nv) below
# sm_89 ("type fp8e4nv not supported in this architecture"), and minfer refuses an fp8 pool there first
# (minfer/formats/hardware.py). bfloat16 likewise from sm_80 on: an sm_75 GPU runs float16.
FP8_ARCHS = (89, 90)
BF16_ARCHS = (80, 86, 89, 90)
GROUPS = {1: (9, 9), 3: (9, 3), 9: (9, 1)}  # GQA group -> (num_heads, num_kv_heads); 3 is SmolLM2-135M
BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 128)  # SmolLM2's 64; 128 as in Llama-style 7B models
INT4_GROUP_SIZES = (32, 64, 128)
MATMUL_ROWS = (1, 7)  # M: one decode row (specialized as a constant 1 at launch) and a general batch
MATMUL_SPLITS = (1, 4)  # slices of K: unsplit (writes the output dtype) and split-K (float32 partials)
MATMUL_SHAPE = (576, 1536)  # N, K: a SmolLM2 down projection; K divides every int4 group size
MOE_SHAPE = (8, 2, 576, 384)  # experts, top-k, hidden, expert intermediate size of the fused MoE launches
BASE = dict(group=3, block_size=16)  # where the other axes are crossed in the default (not --full) set


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel launch the engine makes, described by the axes that choose its constexprs."""
    kernel: str          # the wrapper's name
    axes: tuple          # ((axis, value), ...), e.g. (("dtype", "bf16"), ("kv", "int8"), ...)

    @property
    def params(self) -> dict:
        return dict(self.axes)


def variants(full: bool = False) -> list[Variant]:
    """The launches to compile: the attention kernels and the KV write per (dtype, KV format, GQA group,
    block size, head_dim), the quantized matmuls per (activation dtype, rows, int4 group size, K slices).

    Not ``full``: every value of every axis, crossed where it changes the compiled code. dtype x KV
    format x head_dim in full (they change the tiles and the path ``tl.dot`` takes); the other GQA
    groups and block sizes (integer constants to divide and compare by) with both KV formats, in
    bfloat16 (tensor cores) and float32 (CUDA cores); int4 group sizes with every dtype at 7 rows,
    and one row (a constant 1 at launch) with every dtype, unsplit and split-K (the decode case).
    """
    paged = []
    for dtype, kv, group, block_size, head_dim in itertools.product(DTYPES, KV_FORMATS, GROUPS, BLOCK_SIZES, HEAD_DIMS):
        off_base = (group != BASE["group"]) + (block_size != BASE["block_size"])
        if full or off_base == 0 or (off_base == 1 and head_dim == HEAD_DIMS[0] and dtype in ("bf16", "fp32")):
            paged.append((("dtype", dtype), ("kv", kv), ("group", group), ("block_size", block_size),
                          ("head_dim", head_dim)))
    paged += [(("dtype", dtype), ("kv", "fp8"), ("group", BASE["group"]), ("block_size", BASE["block_size"]),
               ("head_dim", head_dim)) for dtype in DTYPES for head_dim in HEAD_DIMS]
    out = [Variant(name, axes) for name in ("paged_prefill_attention", "paged_decode_attention", "write_kv")
           for axes in paged]
    out += [Variant("int8_matmul", (("dtype", dtype), ("rows", m), ("splits", s)))
            for dtype in DTYPES for m in MATMUL_ROWS for s in MATMUL_SPLITS if full or s == 1 or m == 1]
    out += [Variant("int4_matmul", (("dtype", dtype), ("rows", m), ("group_size", g), ("splits", s)))
            for dtype in DTYPES for m in MATMUL_ROWS for g in INT4_GROUP_SIZES for s in MATMUL_SPLITS
            if full or (s == 1 and (m == MATMUL_ROWS[-1] or g == INT4_GROUP_SIZES[1]))
            or (m == 1 and g == INT4_GROUP_SIZES[1])]
    # the fused MoE's tokens only size its grid (its pairs come sorted), so dtype is its one axis
    out += [Variant(name, (("dtype", dtype),)) for name in ("fused_moe_gate_up", "fused_moe_down") for dtype in DTYPES]
    return out


def default_variants(arch: int) -> list[Variant]:
    """One launch per kernel as the engine makes it by default on ``arch``: dtype="auto" (bfloat16 from sm_80 on,
    float16 below), the model's KV dtype, SmolLM2's GQA group and head_dim, the default block size, one decode row;
    and, where fp8 KV runs (sm_89+), the fp8 pools too."""
    dtype = "bf16" if arch in BF16_ARCHS else "fp16"
    paged = [("group", BASE["group"]), ("block_size", BASE["block_size"]), ("head_dim", HEAD_DIMS[0])]
    kvs = ("auto", "fp8") if arch in FP8_ARCHS else ("auto",)
    out = [Variant(name, (("dtype", dtype), ("kv", kv), *paged))
           for name in ("paged_prefill_attention", "paged_decode_attention", "write_kv") for kv in kvs]
    out.append(Variant("int8_matmul", (("dtype", dtype), ("rows", 1), ("splits", 1))))
    out.append(Variant("int4_matmul", (("dtype", dtype), ("rows", 1), ("group_size", INT4_GROUP_SIZES[1]), ("splits", 1))))
    out += [Variant(name, (("dtype", dtype),)) for name in ("fused_moe_gate_up", "fused_moe_down")]
    return out


# --- what a wrapper launches ------------------------------------------------------------------------

class _Recorder:
    """Stands in for a @triton.jit kernel inside its module: ``kernel[grid](*args, **kwargs)`` records, launches nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


@contextlib.contextmanager
def _recording(module, kernel_name: str):
    """Within the block, ``module``'s kernel records its launches, and the wrapper takes its Triton
    path on CPU tensors (its ``use_triton`` says yes, as it would on CUDA)."""
    kernel, gate = getattr(module, kernel_name), getattr(module, "use_triton")
    recorder = _Recorder()
    setattr(module, kernel_name, recorder)
    setattr(module, "use_triton", lambda x: True)
    try:
        yield kernel, recorder
    finally:
        setattr(module, kernel_name, kernel)
        setattr(module, "use_triton", gate)


def _paged_inputs(dtype: str, kv: str, group: int, block_size: int, head_dim: int) -> dict:
    """Small pools of the engine's layout: 2 sequences of 3 blocks, the second partly filled."""
    num_heads, num_kv_heads = GROUPS[group]
    shape = (6, block_size, num_kv_heads, head_dim)
    torch_dtype = DTYPES[dtype]
    pool_dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}.get(kv, torch_dtype)
    scale_shape = {"int8": shape[:3], "fp8": shape[2:3]}.get(kv)  # per (token, KV head), or per KV head
    scales = dict(k_scales=torch.ones(scale_shape), v_scales=torch.ones(scale_shape)) if scale_shape else {}
    return dict(q=torch.zeros(5, num_heads, head_dim, dtype=torch_dtype), k_pool=torch.zeros(shape, dtype=pool_dtype),
                v_pool=torch.zeros(shape, dtype=pool_dtype), scales=scales,
                block_tables=torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32),  # padded with block 0, as the engine pads
                context_lens=torch.tensor([3 * block_size, block_size + 1], dtype=torch.int32),
                kv_new=torch.zeros(5, num_kv_heads, head_dim, dtype=torch_dtype))


def record_launch(variant: Variant):
    """(jit kernel, args, kwargs) of what ``variant``'s wrapper launches, called with the engine's defaults."""
    p = variant.params
    if variant.kernel in ("paged_decode_attention", "paged_prefill_attention", "write_kv"):
        x = _paged_inputs(**p)
        if variant.kernel == "paged_decode_attention":
            module, name = paged_decode_attention, "_paged_decode_kernel"
            call = lambda: module.paged_decode_attention(x["q"][:2], x["k_pool"], x["v_pool"], x["block_tables"],  # noqa: E731
                                                         x["context_lens"], **x["scales"])
        elif variant.kernel == "paged_prefill_attention":
            module, name = paged_prefill_attention, "_paged_prefill_kernel"
            cu_seqlens_q = torch.tensor([0, 4, 5], dtype=torch.int32)  # a 4-token chunk, then 1 token
            call = lambda: module.paged_prefill_attention(x["q"], x["k_pool"], x["v_pool"], x["block_tables"],  # noqa: E731
                                                          cu_seqlens_q, x["context_lens"], **x["scales"])
        else:
            module, name = paged_cache, "_write_kv_kernel"
            slots = torch.arange(5, dtype=torch.int32)
            call = lambda: module.write_kv(x["k_pool"], x["v_pool"], x["kv_new"], x["kv_new"], slots,  # noqa: E731
                                           x["scales"].get("k_scales"), x["scales"].get("v_scales"))
    elif variant.kernel in ("fused_moe_gate_up", "fused_moe_down"):
        experts, top_k, hidden, inter = MOE_SHAPE
        module, dtype = fused_moe, DTYPES[p["dtype"]]
        tokens = 7
        pairs, blocks = module.align_by_expert(torch.arange(tokens * top_k).view(-1, top_k) % experts, experts, 16)
        if variant.kernel == "fused_moe_gate_up":
            name, x, gate_up = "_moe_gate_up_kernel", torch.zeros(tokens, hidden, dtype=dtype), torch.zeros(
                experts, 2 * inter, hidden, dtype=dtype)
            call = lambda: module.moe_gate_up(x, gate_up, pairs, blocks, top_k)  # noqa: E731
        else:
            name, h, down = "_moe_down_kernel", torch.zeros(tokens * top_k, inter, dtype=dtype), torch.zeros(
                experts, hidden, inter, dtype=dtype)
            call = lambda: module.moe_down(h, down, pairs, blocks, torch.ones(tokens * top_k))  # noqa: E731
    else:
        n, k = MATMUL_SHAPE
        x = torch.zeros(p["rows"], k, dtype=DTYPES[p["dtype"]])
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
        module = quant_matmul
        if variant.kernel == "int8_matmul":
            name, args = "_int8_matmul_kernel", quantize_int8_per_channel(w)
            call = lambda: module.int8_matmul(x, *args, num_splits=p["splits"])  # noqa: E731
        else:
            q, scale, minimum = quantize_int4_groupwise(w, p["group_size"])
            name = "_int4_matmul_kernel"
            call = lambda: module.int4_matmul(x, pack_int4(q), scale, minimum, num_splits=p["splits"])  # noqa: E731
    with _recording(module, name) as (kernel, recorder):
        call()
    if len(recorder.launches) != 1:
        raise RuntimeError(f"{variant.kernel} launched {len(recorder.launches)} kernels, expected 1: "
                           f"did its wrapper stop calling {name} or use_triton?")
    return (kernel, *recorder.launches[0])


# --- compiling for a GPU that is not here -----------------------------------------------------------

def compile_launch(kernel, args: tuple, kwargs: dict, capability: int):
    """Compile ``kernel[grid](*args, **kwargs)`` for an NVIDIA GPU of ``capability`` (80, 90...); no GPU needed.

    Specialized as a launch with these arguments would be: constexpr parameters, and None or an
    integer 1 passed to an ordinary one, are compiled in as constants; pointers and integers
    divisible by 16 carry that fact (``tt.divisibility``), which lets loads vectorize.
    Keyword arguments that are not parameters (num_warps, num_stages) are compiler options.
    """
    if isinstance(kernel, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set when triton was imported: the kernels are interpreted "
                           "functions, which cannot be compiled; run this in a process without it")
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in kernel.arg_names})
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(kernel.params, bound.arguments.values())):
        if param.is_constexpr:
            kind, spec = "constexpr", None
        else:  # the JIT's own rule, e.g. ("*bf16", "D"), ("i32", ""), ("constexpr", 1)
            kind, spec = native_specialize_impl(backend, value, param.is_const, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = value
        elif spec:
            attrs[(i,)] = backend.parse_attr(spec)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)


def compile_with_report(kernel, args: tuple, kwargs: dict, capability: int) -> tuple:
    """``compile_launch``, and the report of the ``ptxas -v`` that Triton runs as its last step: it
    prints it with ``knobs.nvidia.dump_ptxas_log`` set. Empty when the kernel came from Triton's cache."""
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        compiled = compile_launch(kernel, args, kwargs, capability)
    return compiled, report.getvalue()


def ptxas_resources(ptx: str, capability: int, report: str = "") -> dict:
    """Registers per thread, stack frame and spilled bytes of a kernel, from a ``ptxas -v`` report on
    its PTX: the one given, else from running ptxas with the flags Triton's last step uses (0.1 s)."""
    arch = sm_arch_from_capability(capability)  # sm_80, sm_90a
    if "registers" not in report:  # the kernel came from Triton's cache: assemble it again, with -v
        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder) / "kernel.ptx"
            source.write_text(ptx)
            done = subprocess.run([get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                                   f"--gpu-name={arch}", str(source), "-o", str(Path(folder) / "kernel.cubin")],
                                  capture_output=True, text=True)
        report = done.stdout + done.stderr
        if done.returncode:
            raise RuntimeError(f"ptxas -v for {arch} failed:\n{report[-2000:]}")
    registers = re.search(r"Used (\d+) registers", report)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or frame is None:
        raise RuntimeError(f"ptxas -v for {arch} said something unexpected:\n{report[-2000:]}")
    return dict(registers=int(registers.group(1)), stack=int(frame.group(1)), spill_stores=int(frame.group(2)),
                spill_loads=int(frame.group(3)))


def problems(row: dict) -> list[str]:
    """What would fail (shared memory, registers over the limit) or slow down (spills) on the row's GPU."""
    found = []
    if row["shared"] > SHARED_LIMIT[row["arch"]]:
        found.append(f"shared memory {row['shared']} B > {SHARED_LIMIT[row['arch']]} B")
    if row["registers"] > MAX_REGISTERS:
        found.append(f"{row['registers']} registers > {MAX_REGISTERS}")
    if max(row["spill_stores"], row["spill_loads"]) > TOLERATED_SPILL_BYTES:
        found.append(f"register spills: {row['spill_stores']} B stored, {row['spill_loads']} B loaded per thread")
    return found


def compiled_resources(compiled, capability: int, ptxas_report: str = "") -> dict:
    """The resource row of a compiled kernel, its problems included."""
    row = dict(arch=capability, shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
               num_stages=compiled.metadata.num_stages,
               **ptxas_resources(compiled.asm["ptx"], capability, ptxas_report))
    row["problems"] = problems(row)
    return row


def compile_variant(variant: Variant, capability: int) -> dict:
    """Record, compile and measure one variant for one architecture; a failure is reported, not raised."""
    row = dict(kernel=variant.kernel, params=variant.params, arch=capability)
    start = time.perf_counter()
    try:
        kernel, args, kwargs = record_launch(variant)
        row["constexprs"] = {k: v for k, v in kwargs.items() if k in kernel.arg_names}
        compiled, report = compile_with_report(kernel, args, kwargs, capability)
        row.update(compiled_resources(compiled, capability, report))
    except Exception as error:  # noqa: BLE001 -- the table says which variant failed and why
        row["error"] = f"{type(error).__name__}: {error}"[-2000:]
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _compile_job(job: tuple) -> dict:
    return compile_variant(*job)


def compile_all(archs=tuple(ARCHS), jobs: int = 1, full: bool = False) -> list[dict]:
    """Every variant for the architectures in FULL_ARCHS, the default launches for the others, in ``jobs`` processes;
    fp8 pools only from sm_89 on, bfloat16 only from sm_80 on."""
    work = [(variant, arch) for arch in archs for variant in (variants(full) if arch in FULL_ARCHS else default_variants(arch))
            if (variant.params.get("kv") != "fp8" or arch in FP8_ARCHS) and (variant.params["dtype"] != "bf16" or arch in BF16_ARCHS)]
    if jobs <= 1:
        return [_compile_job(job) for job in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_job, work))


# --- the table --------------------------------------------------------------------------------------

MERGED_AXES = {"group": "GQA", "block_size": "block", "rows": "M", "group_size": "int4 g", "splits": "K slices"}


def markdown(rows: list[dict]) -> str:
    """One line per kernel, dtype, KV format and head_dim, with the GQA groups and block sizes (or the
    matmul's rows and int4 group sizes) it covers merged, showing their largest resources; per
    architecture: the shared memory a launch requests (KiB), registers per thread, bytes spilled."""
    archs = sorted({r["arch"] for r in rows})
    merged: dict = {}
    for r in rows:
        key = (r["kernel"],) + tuple((k, v) for k, v in r["params"].items() if k not in MERGED_AXES)
        entry = merged.setdefault(key, {"values": {}, "tiles": set(), "archs": {}})
        for axis, value in r["params"].items():
            if axis in MERGED_AXES:
                entry["values"].setdefault(axis, set()).add(value)
        worst = entry["archs"].setdefault(r["arch"], {"shared": 0, "registers": 0, "spill": 0, "error": False})
        if "error" in r:
            worst["error"] = True
            continue
        entry["tiles"].add(_tiles(r["kernel"], r["constexprs"]) + f", {r['num_warps']} warps")
        worst["shared"] = max(worst["shared"], r["shared"])
        worst["registers"] = max(worst["registers"], r["registers"])
        worst["spill"] = max(worst["spill"], r["spill_stores"])
    header = ["kernel", "dtype", "KV / weights", "head_dim", "covers", "tiles"]
    for arch in archs:
        header += [f"sm_{arch} shared KiB", f"sm_{arch} regs", f"sm_{arch} spill B"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header[:6]) + "---:|" * (3 * len(archs))]
    for (kernel, *axes), entry in merged.items():
        p = dict(axes)
        weights = {"int8_matmul": "int8", "int4_matmul": "int4", "fused_moe_gate_up": "experts", "fused_moe_down": "experts"}
        covers = "; ".join(f"{MERGED_AXES[axis]} {','.join(map(str, sorted(values)))}"
                           for axis, values in entry["values"].items())
        cells = [kernel, p["dtype"], p.get("kv", weights.get(kernel)), str(p.get("head_dim", "-")), covers,
                 "; ".join(sorted(entry["tiles"]))]
        for arch in archs:
            a = entry["archs"].get(arch)
            if a is None:  # not compiled for this architecture: only the default launches, or fp8/bf16 not there
                cells += ["not built", "", ""]
                continue
            cells += ["compile error", "", ""] if a["error"] else [
                f"{a['shared'] / 1024:.1f}", str(a["registers"]), str(a["spill"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _tiles(kernel: str, constexprs: dict) -> str:
    names = {"paged_decode_attention": ("BLOCK_G", "BLOCK_N", "BLOCK_D"),
             "paged_prefill_attention": ("BLOCK_M", "BLOCK_N", "BLOCK_D"),
             "write_kv": ("BLOCK_H", "BLOCK_D")}.get(kernel, ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    return "x".join(str(constexprs[n]) for n in names if n in constexprs)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", type=int, nargs="+", default=list(ARCHS), choices=list(ARCHS),
                        help="compute capabilities to compile for (default: all of them)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    parser.add_argument("--full", action="store_true", help="every combination of the axes, not every value")
    parser.add_argument("--json", help="also write every row (one per variant and architecture) to this file")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    rows = compile_all(tuple(args.archs), args.jobs, args.full)
    seconds = time.perf_counter() - start
    print(markdown(rows))
    failed = [r for r in rows if "error" in r or r["problems"]]
    for r in failed:
        print(f"\n{r['kernel']} {r['params']} sm_{r['arch']}: {r.get('error') or '; '.join(r['problems'])}")
    variant_count = len({(r["kernel"], json.dumps(r["params"], sort_keys=True)) for r in rows})
    print(f"\n{len(rows)} compilations of {variant_count} variants for sm_{', sm_'.join(map(str, args.archs))} (every variant "
          f"for {', '.join(f'sm_{a}' for a in FULL_ARCHS)}, the default launches for the others; fp8 pools from sm_89 on) "
          f"in {seconds:.0f} s with {args.jobs} processes, "
          f"triton {triton.__version__}; "
          f"{len(failed)} with errors or problems")
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "seconds": seconds, "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
