"""The int4 matmul's K loop, compiled for sm_80 and sm_90 without a GPU: how many instructions it spends per weight.

benchmarks/sass_inner_loop.py compiles the decode launch (one row, K unsplit), disassembles the cubin
with the nvdisasm inside the triton wheel and counts the body of the K loop. SASS is deterministic for a
given Triton and ptxas, so the figures are exact: the bounds below are the figures the magic-number
kernel reaches (plus a few instructions' margin for another Triton version's scheduling), and the
factor it gained on the int-to-float kernel it replaced (docs/kernels.md).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NVDISASM = REPO / ".venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/nvdisasm"
pytestmark = pytest.mark.slow

# instructions per weight of the int-to-float kernel (shift, mask, I2F, multiply-add per weight; bytes loaded
# one by one), (dtype, group size, arch) -> figure, at the same tiles (16 x 64; 16 x 32 for group 32), 128 threads;
# the present kernel gives group 32's tile 64 (quant_matmul.int4_warps)
BEFORE = {(d, g, a): {80: 23.50, 90: 22.75}[a] if g > 32 else {80: 28.75, 90: 27.00}[a]
          for d in ("bf16", "fp16") for g in (32, 64, 128) for a in (80, 90)}
AFTER = {(d, g, a): {("bf16", 80): 14.38, ("bf16", 90): 14.00, ("fp16", 80): 12.75, ("fp16", 90): 11.88}[d, a]
         for d in ("bf16", "fp16") for g in (64, 128) for a in (80, 90)}
AFTER.update({("bf16", 32, 80): 13.12, ("bf16", 32, 90): 13.38, ("fp16", 32, 80): 11.50, ("fp16", 32, 90): 11.12})
MARGIN = 0.5  # per weight: four instructions in a 128-thread loop over 16 x 64 weights


def figures() -> list[dict]:
    """The rows of sass_inner_loop.loop_figures for int4 in every group size, bf16 and fp16, sm_80 and sm_90."""
    script = (f"import json, sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import sass_inner_loop as s\n"
              "rows = [s.loop_figures(v, a) for v in s.matmul_variants(['bf16', 'fp16'], [32, 64, 128], 1)\n"
              "        if v.kernel == 'int4_matmul' for a in (80, 90)]\n"
              "print(json.dumps([{k: r[k] for k in ('params', 'arch', 'per_weight', 'by_opcode')} for r in rows]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not NVDISASM.exists(), reason="nvdisasm ships with triton's NVIDIA backend, absent here")
def test_int4_loop_spends_fewer_instructions_per_weight():
    rows = figures()
    assert len(rows) == 12
    for r in rows:
        key = (r["params"]["dtype"], r["params"]["group_size"], r["arch"])
        where = f"{r['params']} sm_{r['arch']}: {r['per_weight']:.2f} per weight, {r['by_opcode']}"
        assert r["per_weight"] <= AFTER[key] + MARGIN, where
        assert BEFORE[key] / r["per_weight"] >= 1.6, where  # 1.63x (bf16 g64 sm_90)..2.43x (fp16 g32 sm_90) reached
        assert "I2F" not in r["by_opcode"] and "I2FP" not in r["by_opcode"], where  # no int-to-float conversion
        if r["params"]["dtype"] == "fp16":
            assert "FFMA" not in r["by_opcode"] and "HFMA2" in r["by_opcode"], where  # two weights per multiply-add
        assert "LDG" in r["by_opcode"] or "LDGSTS" in r["by_opcode"], where  # the loop found is the K loop
