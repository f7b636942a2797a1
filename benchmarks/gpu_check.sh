#!/usr/bin/env bash
# The generation benchmark on a CUDA machine that has no model file and no package index.
#
#   benchmarks/gpu_check.sh OUT_DIR     # writes OUT_DIR/{env.txt,bench_generate.{json,md,log},kernel_tests.log,bench_kernels.{json,log},bench_compiled.{json,log}}
#
# Needs python with torch (CUDA build) and transformers; minfer is used from this checkout (no install).
# The real SmolLM2 weights do not travel, so it benchmarks random weights of the same shapes, saved as a
# Hugging Face checkpoint with a stand-in tokenizer; the prompts are token ids. Speed depends on the
# shapes only, so the numbers compare with the real model's. Then (on CUDA) the Triton kernel tests without
# the interpreter (tests/test_kernel_compile.py, tests/test_kernels.py) and their bandwidth benchmark
# (PEAK_GBPS, default 4800 for an H200), then eager vs compiled decode steps. Under 10 minutes.
# Overrides (used by the CPU test of this script): PYTHON, DEVICE (cuda), SHAPES (smollm2-135m),
# BENCH_ARGS (extra arguments for `python -m minfer bench`), TIME_LIMIT (seconds, 180).
set -euo pipefail

OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
SHAPES=${SHAPES:-smollm2-135m}
TIME_LIMIT=${TIME_LIMIT:-180}
read -r -a EXTRA <<< "${BENCH_ARGS:-}"

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$PYTHON" - "$DEVICE" > "$OUT/env.txt" 2>&1 <<'PY' || { cat "$OUT/env.txt" >&2; echo "gpu_check: environment check failed" >&2; exit 1; }
import platform, sys
import torch
import transformers
device = sys.argv[1]
print("python", platform.python_version(), "| torch", torch.__version__, "| transformers", transformers.__version__)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
print("cuda available:", torch.cuda.is_available(), "| torch.version.cuda:", torch.version.cuda)
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit("DEVICE=cuda but torch sees no GPU")
    p = torch.cuda.get_device_properties(0)
    print("gpu:", p.name, f"| {p.total_memory / 2**30:.0f} GiB | {p.multi_processor_count} SMs")
    print("tf32 matmul:", torch.backends.cuda.matmul.allow_tf32)
PY
cat "$OUT/env.txt"

status=0
timeout "$TIME_LIMIT" "$PYTHON" -m minfer bench --random-weights "$SHAPES" --device "$DEVICE" \
    --dtypes float32 bfloat16 --batch-sizes 1 16 --max-tokens 64 --prompt-len 64 --repeats 3 --floor-steps 50 \
    --json "$OUT/bench_generate.json" --markdown "$OUT/bench_generate.md" --no-progress "${EXTRA[@]}" \
    2>&1 | tee "$OUT/bench_generate.log" || status=$?
if [ "$status" -ne 0 ]; then
    echo "gpu_check: the benchmark failed (exit $status); see $OUT/bench_generate.log" >&2
    exit "$status"
fi
if [[ "$DEVICE" == cuda* ]]; then
    # The Triton kernels compiled, never interpreted: every variant for sm_80/sm_90 within its shared memory
    # and registers, each kernel against its reference on this GPU (test_kernel_compile.py runs the int8-KV
    # and quantized-matmul ones, which their own test files interpret), then their share of bandwidth.
    env -u TRITON_INTERPRET timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_kernel_compile.py \
        tests/test_kernels.py 2>&1 | tee "$OUT/kernel_tests.log" || status=$?
    timeout 60 "$PYTHON" benchmarks/bench_kernels.py --peak-gbps "${PEAK_GBPS:-4800}" --json "$OUT/bench_kernels.json" \
        2>&1 | tee "$OUT/bench_kernels.log" || status=$?
    # The engine's decode step eager vs through torch.compile (enforce_eager), on the paged pool and kernels.
    timeout 300 "$PYTHON" benchmarks/bench_compiled.py --random-weights "$SHAPES" --device "$DEVICE" \
        --dtypes bfloat16 --batch-sizes 1 16 --json "$OUT/bench_compiled.json" 2>&1 | tee "$OUT/bench_compiled.log" || status=$?
fi
echo "gpu_check: results in $OUT (exit $status)"
exit "$status"
