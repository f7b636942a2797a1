"""How many machine instructions the quantized matmuls spend per weight, read from their compiled K loop.

    python benchmarks/sass_inner_loop.py                       # int8 and int4 (g64, g128), bf16/fp16, sm_80 and sm_90
    python benchmarks/sass_inner_loop.py --dtypes bf16 --group-sizes 128 --archs 90 --listing

A weight-only matmul at decode sizes is memory-bound only if its loop keeps up with the memory: every
weight a thread loads must be turned into a float the tensor cores take, and each instruction that costs
is issued by a warp scheduler that has a few cycles per byte to spare. The speed needs a GPU; the
instructions do not. Each variant is compiled the way the engine launches it (``kernel_resources.py``
records the wrapper's launch and compiles it for sm_80 or sm_90 with the ptxas inside the triton wheel),
the cubin is disassembled with ``nvdisasm``, and the main loop is the body of the K loop: the code
between the target of the loop's backward branch and that branch.

    instructions per weight = loop instructions x threads per program / (BLOCK_N x BLOCK_K)

i.e. what the whole program (all its warps) issues per weight it handles in one K step, the activations'
loads, the address arithmetic and the loop's own bookkeeping included. The opcodes are counted by class:
memory (global LDG, shared LDS/STS, ...), integer (LOP3, SHF, IMAD, PRMT...), float conversion and
16-bit float arithmetic (I2F, F2F, HADD2, HFMA2...), 32-bit float (FFMA, FMUL...), tensor core (HMMA) and
the rest (branches, predicates, barriers).
"""
from __future__ import annotations

import os

# @triton.jit reads TRITON_INTERPRET when it decorates a function (see kernel_resources.py)
os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_resources as kr  # noqa: E402

import triton  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"

CLASSES = {  # opcode (before the first dot) -> class; anything else is "other"
    "memory": ("LDG", "LDS", "STS", "LDSM", "STG", "LDGSTS", "LDL", "STL", "LD", "ST", "LDC", "ULDC", "LDGDEPBAR",
               "DEPBAR"),
    "integer": ("LOP3", "SHF", "IMAD", "IADD3", "PRMT", "LEA", "SEL", "ISETP", "IMNMX", "MOV", "IABS", "SGXT", "BMSK",
                "LOP", "SHL", "SHR", "UIADD3", "UIMAD", "ULOP3", "USHF", "UMOV", "ULEA", "USEL", "UISETP", "UPRMT"),
    "conversion / fp16": ("I2F", "F2F", "F2I", "I2FP", "F2FP", "HADD2", "HFMA2", "HMUL2", "HSETP2"),
    "fp32": ("FFMA", "FMUL", "FADD", "FSEL", "FSETP", "FMNMX"),
    "tensor core": ("HMMA", "IMMA", "HGMMA"),
}
CLASS_OF = {op: name for name, ops in CLASSES.items() for op in ops}
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*([^;]*);")
LABEL = re.compile(r"^(\.L_\w+):", re.MULTILINE)  # a branch target: the instruction after it


def disassemble(cubin: bytes) -> str:
    """nvdisasm's listing of a cubin (addresses, opcodes, operands)."""
    if not NVDISASM.exists():
        raise FileNotFoundError(f"nvdisasm not found at {NVDISASM}: it ships with the triton wheel")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(NVDISASM), "-c", str(path)], capture_output=True, text=True, check=True).stdout


def instructions(listing: str) -> list[tuple[int, str, str]]:
    """(address, opcode with its modifiers, operands) of every instruction in an nvdisasm listing, with
    branch targets written as addresses (nvdisasm names them ``.L_x_1``)."""
    labels = {}
    for m in LABEL.finditer(listing):
        following = INSTRUCTION.search(listing, m.end())
        labels[m.group(1)] = f"0x{following.group(1)}" if following else "0xffffffff"
    found = [(int(m.group(1), 16), m.group(3) + m.group(4), m.group(5).strip()) for m in INSTRUCTION.finditer(listing)]
    return [(a, op, re.sub(r"\.L_\w+", lambda t: labels.get(t.group(0), t.group(0)), operands)) for a, op, operands in found]


def main_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The body of the longest backward branch (``BRA`` to an earlier address): the K loop of a matmul,
    whose body the compiler lays out between the branch's target and the branch."""
    loops = []
    for i, (address, opcode, operands) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", operands)
        if opcode.startswith("BRA") and target and int(target.group(1), 16) <= address:
            start = next(j for j, (a, _, _) in enumerate(code) if a >= int(target.group(1), 16))
            loops.append(code[start:i + 1])
    if not loops:
        raise RuntimeError("no backward branch: the kernel has no loop")
    return max(loops, key=len)


def opcode_class(opcode: str) -> str:
    return CLASS_OF.get(opcode.split(".")[0], "other")


def loop_figures(variant: kr.Variant, capability: int) -> dict:
    """Compile one matmul variant for ``capability`` and count its K loop: instructions, per weight, by class and opcode."""
    kernel, args, kwargs = kr.record_launch(variant)
    constexprs = {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    compiled, _ = kr.compile_with_report(kernel, args, kwargs, capability)  # ptxas's report captured, not printed
    loop = main_loop(instructions(disassemble(compiled.asm["cubin"])))
    threads = compiled.metadata.num_warps * 32
    weights = constexprs["BLOCK_N"] * constexprs["BLOCK_K"]
    by_class = collections.Counter(opcode_class(op) for _, op, _ in loop)
    by_opcode = collections.Counter(op.split(".")[0] for _, op, _ in loop)
    return dict(kernel=variant.kernel, params=variant.params, arch=capability, constexprs=constexprs, threads=threads,
                loop=len(loop), per_weight=len(loop) * threads / weights,
                per_weight_by_class={c: by_class[c] * threads / weights for c in [*CLASSES, "other"]},
                by_opcode=dict(by_opcode.most_common()), listing=[f"{op} {operands}" for _, op, operands in loop])


def matmul_variants(dtypes: list[str], group_sizes: list[int], rows: int) -> list[kr.Variant]:
    """The decode launches (unsplit K) of int8 and int4 for each activation dtype and int4 group size."""
    out = [kr.Variant("int8_matmul", (("dtype", d), ("rows", rows), ("splits", 1))) for d in dtypes]
    out += [kr.Variant("int4_matmul", (("dtype", d), ("rows", rows), ("group_size", g), ("splits", 1)))
            for d in dtypes for g in group_sizes]
    return out


def markdown(rows: list[dict]) -> str:
    classes = [*CLASSES, "other"]
    lines = ["| kernel | dtype | int4 g | arch | tiles, threads | loop instructions | per weight | "
             + " | ".join(classes) + " |", "|---|---|---|---|---|---:|---:|" + "---:|" * len(classes)]
    for r in rows:
        c = r["constexprs"]
        lines.append(f"| {r['kernel']} | {r['params']['dtype']} | {r['params'].get('group_size', '-')} | sm_{r['arch']} | "
                     f"{c['BLOCK_N']}x{c['BLOCK_K']}, {r['threads']} | {r['loop']} | {r['per_weight']:.2f} | "
                     + " | ".join(f"{r['per_weight_by_class'][k]:.2f}" for k in classes) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", type=int, nargs="+", default=[80, 90], choices=list(kr.ARCHS))
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=list(kr.DTYPES))
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[64, 128], choices=list(kr.INT4_GROUP_SIZES))
    parser.add_argument("--rows", type=int, default=1, help="activation rows M (1: a decode step)")
    parser.add_argument("--listing", action="store_true", help="also print each loop's instructions and opcode counts")
    args = parser.parse_args(argv)
    if not NVDISASM.exists() or shutil.which(str(NVDISASM)) is None:
        print(f"sass_inner_loop: nvdisasm not found at {NVDISASM}")
        return 1
    rows = [loop_figures(v, arch) for v in matmul_variants(args.dtypes, args.group_sizes, args.rows)
            for arch in args.archs]
    print(markdown(rows))
    if args.listing:
        for r in rows:
            print(f"\n{r['kernel']} {r['params']} sm_{r['arch']}: {r['by_opcode']}")
            print("\n".join("    " + line for line in r["listing"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
