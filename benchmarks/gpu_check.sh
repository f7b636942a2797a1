#!/usr/bin/env bash
# The course on a CUDA machine in one command of under 10 minutes (TOTAL_LIMIT, 500 s, leaves time to pack
# the results): each chapter's GPU cells with the real model, the random-weight
# generation benchmark, the Triton kernel tests and benchmarks; eager vs compiled decode steps and whole notebooks
# only when asked for (PARTS), when there is time for them.
#
#   benchmarks/gpu_check.sh OUT_DIR     # OUT_DIR/{env.txt, summary.md, gpu/*.json, gpu-cells/{summary.*, notebooks/*.ipynb,
#                                       #   figures/*.png}, bench_generate.*, kernel_tests.log, bench_kernels.*,
#                                       #   bench_speculative.*, bench_overlap.*, bench_compiled.*, and with PARTS=notebooks
#                                       #   whole-notebooks/ as gpu-cells/}
#
# Needs python with torch (CUDA build), transformers, triton, nbclient and ipykernel; minfer is used from this
# checkout (no install). docs/gpu.md says how the real model's file and the missing packages reach a GPU machine
# without network.
# Parts (PARTS, default "gpu-cells bench kernels speculative overlap"; they run in this order):
#   gpu-cells  in every chapter (NOTEBOOKS), only its GPU cells (those that call gpu_cell) and the cells they
#              need (benchmarks/run_notebooks.py --cells gpu, MINFER_IMPL=solutions, NB_TIMEOUT seconds per
#              notebook): executed copies, their figures and summary in OUT_DIR/gpu-cells/ (never over the course
#              notebooks); a chapter without a GPU cell is listed as "no gpu cell"; the GPU cells store their
#              figures in OUT_DIR/gpu/, copied to docs/gpu/ when DEVICE is cuda;
#   bench      the generation benchmark on random weights of the model's shapes (saved as a Hugging Face checkpoint
#              with a stand-in tokenizer; speed depends on the shapes only);
#   kernels    (CUDA) the Triton kernel tests without the interpreter and fp8 weights' W8A8 test, chapter 03's
#              exercise tests with the worked kernels (the learner's kernel timed: OUT_DIR/ch03_exercise.xml), the
#              paged kernel's bandwidth share (PEAK_GBPS, 4800) and the int8 / int4 (g64, g128) / fp8 weight matmuls
#              against dense bfloat16 on Llama-3.1-8B's linears, 1 and 16 rows;
#   speculative (CUDA) speculative decoding at batch 1 on the real model: n-gram lookup, the EAGLE head and the
#              distilled draft (k = 3) against plain decoding, each with the engine's defaults (CUDA graphs);
#   overlap    (CUDA) async scheduling against the synchronous engine, decode steps of the tiny host-bound model
#              and of the real one (benchmarks/bench_overlap.py);
#   compiled   (CUDA; optional, not in the default PARTS) eager vs compiled decode steps;
#   notebooks  (optional, not in the default PARTS: when there is time for it) every cell of every chapter,
#              into OUT_DIR/whole-notebooks/ as gpu-cells does, with the time left (its GPU cells' figures
#              replace gpu-cells' in OUT_DIR/gpu/).
# gpu-cells leaves the time the later asked-for parts usually need (bench 60 s, on CUDA kernels 200 s,
# speculative 90 s, overlap 60 s and compiled 60 s), and is skipped with under 20 s of its own; every other part's limit is cut to what is left of TOTAL_LIMIT; a part with under 20 s left is
# skipped. OUT_DIR/summary.md gathers the notebook parts' tables, also when the script is stopped by a signal.
# Overrides (the CPU rehearsal and its test use them): PYTHON, DEVICE (cuda; cpu: a rehearsal, whose GPU cells
# measure on the CPU with small settings), PARTS, NOTEBOOKS (paths), NB_TIMEOUT (90), TOTAL_LIMIT (500),
# SHAPES (smollm2-135m), BENCH_ARGS (extra arguments for `python -m minfer bench`), TIME_LIMIT (the bench's, 120).
set -euo pipefail

OUT=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
SHAPES=${SHAPES:-smollm2-135m}
TIME_LIMIT=${TIME_LIMIT:-120}
TOTAL_LIMIT=${TOTAL_LIMIT:-500}
NB_TIMEOUT=${NB_TIMEOUT:-90}
PARTS=" ${PARTS:-gpu-cells bench kernels speculative overlap} "
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
for name in ("nbclient", "ipykernel", "gguf", "fastapi", "openai"):  # the notebooks' needs (docs/gpu.md: carried wheels)
    try:
        print(name, getattr(__import__(name), "__version__", "installed"))
    except ImportError:
        print(name + ": not installed")
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit("DEVICE=cuda but torch sees no GPU")
    p = torch.cuda.get_device_properties(0)
    print("gpu:", p.name, f"| {p.total_memory / 2**30:.0f} GiB | {p.multi_processor_count} SMs")
    print("tf32 matmul:", torch.backends.cuda.matmul.allow_tf32)
PY
cat "$OUT/env.txt"

status=0
# Each command's limit; --foreground keeps it in this script's process group, so that a signal to the group
# (from an outer `timeout`, for example) stops it at once, and the EXIT trap still runs.
TIMEOUT=(timeout --foreground -k 10)
left() { echo $(( TOTAL_LIMIT - SECONDS )); }
limit() { local l; l=$(left); echo $(( $1 < l ? $1 : l )); }  # a part's limit, cut to what is left
part() {  # part NAME: is it asked for, and is there time left for it?
    [[ "$PARTS" == *" $1 "* ]] || return 1
    if [ "$(left)" -lt 20 ]; then echo "gpu_check: no time left for $1 (TOTAL_LIMIT=$TOTAL_LIMIT)"; status=1; return 1; fi
}

if [ -n "${NOTEBOOKS:-}" ]; then read -r -a BOOKS <<< "$NOTEBOOKS"; else BOOKS=(notebooks/[0-9]*.ipynb); fi
rm -rf "$OUT/gpu" "$OUT/gpu-cells" "$OUT/whole-notebooks" "$OUT/summary.md" && mkdir -p "$OUT/gpu"
rehearse=0; hide=()
[[ "$DEVICE" == cuda* ]] || { rehearse=1; hide=(env CUDA_VISIBLE_DEVICES=); }  # a rehearsal runs on the CPU
summarize() {  # OUT/summary.md: the notebook parts' tables (also on the way out after a signal)
    local dir
    for dir in gpu-cells whole-notebooks; do
        if [ -f "$OUT/$dir/summary.md" ]; then printf '## %s\n\n%s\n\n' "$dir" "$(cat "$OUT/$dir/summary.md")"; fi
    done > "$OUT/summary.md"
    [ -s "$OUT/summary.md" ] || rm -f "$OUT/summary.md"
}
trap summarize EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
notebooks() {  # notebooks NAME CELLS SHARE: run_notebooks.py into OUT/NAME within SHARE seconds
    MINFER_IMPL=solutions MINFER_GPU_FIGURES="$OUT/gpu" MINFER_GPU_REHEARSE=$rehearse \
        "${hide[@]}" "${TIMEOUT[@]}" "$(( $3 + 30 ))" "$PYTHON" benchmarks/run_notebooks.py "$OUT/$1" "${BOOKS[@]}" \
        --cells "$2" --budget "$NB_TIMEOUT" --total "$3" 2>&1 | tee "$OUT/$1.log" || status=$?
    if [[ "$DEVICE" == cuda* ]] && compgen -G "$OUT/gpu/*.json" > /dev/null; then
        mkdir -p docs/gpu && cp "$OUT"/gpu/*.json docs/gpu/  # in this checkout; copy them from OUT into yours
    fi
    summarize
}
reserve=0  # the time the bench, kernels and compiled parts usually take, when they will run (after gpu-cells)
[[ "$PARTS" == *" bench "* ]] && reserve=$(( reserve + 60 ))
[[ "$DEVICE" == cuda* && "$PARTS" == *" kernels "* ]] && reserve=$(( reserve + 200 ))
[[ "$DEVICE" == cuda* && "$PARTS" == *" speculative "* ]] && reserve=$(( reserve + 90 ))
[[ "$DEVICE" == cuda* && "$PARTS" == *" overlap "* ]] && reserve=$(( reserve + 60 ))
[[ "$DEVICE" == cuda* && "$PARTS" == *" compiled "* ]] && reserve=$(( reserve + 60 ))

if part gpu-cells; then
    share=$(( $(left) - reserve ))
    if [ "$share" -ge 20 ]; then notebooks gpu-cells gpu "$share"
    else echo "gpu_check: no time left for gpu-cells after the later parts' $reserve s (TOTAL_LIMIT=$TOTAL_LIMIT)"; status=1; fi
fi
if part bench; then
    "${TIMEOUT[@]}" "$(limit "$TIME_LIMIT")" "$PYTHON" -m minfer bench --random-weights "$SHAPES" --device "$DEVICE" \
        --dtypes float32 bfloat16 --batch-sizes 1 16 --max-tokens 64 --prompt-len 64 --repeats 3 --floor-steps 50 \
        --json "$OUT/bench_generate.json" --markdown "$OUT/bench_generate.md" --no-progress "${EXTRA[@]}" \
        2>&1 | tee "$OUT/bench_generate.log" || status=$?
fi
if [[ "$DEVICE" == cuda* ]] && part kernels; then
    # The Triton kernels compiled, never interpreted: every variant for sm_80/sm_90 within its shared memory
    # and registers, each kernel against its reference on this GPU (test_kernel_compile.py runs the int8-KV
    # and quantized-matmul ones, which their own test files interpret), the engine's decode steps recorded as
    # CUDA graphs against eager ones, then the kernels' share of bandwidth.
    env -u TRITON_INTERPRET "${TIMEOUT[@]}" "$(limit 150)" "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_kernel_compile.py \
        tests/test_kernels.py tests/test_fused_moe.py tests/test_cuda_graphs.py::test_cuda_graphs_on_a_gpu \
        tests/test_quant_fp8.py::test_w8a8_on_the_gpu_at_decode_row_counts_and_under_cuda_graphs \
        2>&1 | tee "$OUT/kernel_tests.log" || status=$?
    # chapter 03's exercise tests with the worked kernels: on CUDA one of them times the learner's kernel against
    # the gather reference (its speedup is a property in the JUnit file, as check("ch03") prints it)
    env -u TRITON_INTERPRET MINFER_IMPL=solutions "${TIMEOUT[@]}" "$(limit 60)" "$PYTHON" -m pytest -q -p no:cacheprovider \
        tests/exercises/test_ch03_paged_attention.py --junitxml "$OUT/ch03_exercise.xml" 2>&1 | tee -a "$OUT/kernel_tests.log" \
        || status=$?
    "${TIMEOUT[@]}" "$(limit 90)" "$PYTHON" benchmarks/bench_kernels.py --peak-gbps "${PEAK_GBPS:-4800}" \
        --context-lens 2048 32768 --matmul-shapes llama --group-sizes 64 128 --json "$OUT/bench_kernels.json" \
        2>&1 | tee "$OUT/bench_kernels.log" || status=$?
fi
if [[ "$DEVICE" == cuda* ]] && part speculative; then
    "${TIMEOUT[@]}" "$(limit 90)" "$PYTHON" benchmarks/bench_speculative.py --device "$DEVICE" --dtype bfloat16 \
        --clock wall --proposers "[ngram]" smollm2-135m-eagle smollm2-135m-draft --ks 3 --num-prompts 2 \
        --max-tokens 64 --json "$OUT/bench_speculative.json" 2>&1 | tee "$OUT/bench_speculative.log" || status=$?
fi
if [[ "$DEVICE" == cuda* ]] && part overlap; then
    "${TIMEOUT[@]}" "$(limit 60)" "$PYTHON" benchmarks/bench_overlap.py --device "$DEVICE" --rounds 2 --steps 30 \
        --json "$OUT/bench_overlap.json" 2>&1 | tee "$OUT/bench_overlap.log" || status=$?
fi
if [[ "$DEVICE" == cuda* ]] && part compiled; then
    # The engine's decode step eager vs enforce_eager=False (on CUDA: replayed as CUDA graphs), random weights.
    "${TIMEOUT[@]}" "$(limit 120)" "$PYTHON" benchmarks/bench_compiled.py --random-weights "$SHAPES" --device "$DEVICE" \
        --dtypes bfloat16 --batch-sizes 1 16 --json "$OUT/bench_compiled.json" 2>&1 | tee "$OUT/bench_compiled.log" || status=$?
fi
if part notebooks; then  # whole notebooks, with whatever time is left
    notebooks whole-notebooks all "$(left)"
fi
[ -f "$OUT/summary.md" ] && cat "$OUT/summary.md"
echo "gpu_check: results in $OUT after ${SECONDS} s (exit $status)"
exit "$status"
