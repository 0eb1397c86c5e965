#!/usr/bin/env bash
# One GPU call for a change to the decode step's kernels, within ~5 minutes:
#   1. correctness, in parallel (neither is timed): the kernel tests at real sizes and the
#      gpu-marked engine tests (GPU greedy/logits against the CPU path);
#   2. `bench kernels` on the Moonlight fused-MoE cases, tuning the MXFP4 decode shapes; the
#      merged config table is installed into kernels/triton/configs/ for step 3;
#   3. `bench decode-moe` without transformers (its numbers are in the JSON already).
# Each stage logs to $OUT and later stages run even if an earlier one fails.
#   scripts/gpu_step_check.sh [decode-moe options, default --hf-batches "" --batches 1,32,128,256]
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 BATCHGEN_BENCH_DIR="$OUT"
T1=${TESTS_TIMEOUT:-50}
T2=${KBENCH_TIMEOUT:-90}
T3=${DECODE_TIMEOUT:-180}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used \
    --format=csv >"$OUT/nvidia-smi.txt" 2>&1
start=$(date +%s)
timeout "$T1" python3 -m pytest -o addopts="" -p no:cacheprovider -m "not slow" -q -rfE \
    tests/kernels/test_fused_moe.py tests/kernels/test_rmsnorm_rope.py \
    tests/kernels/test_fp8_linear.py >"$OUT/tests_kernels.log" 2>&1 &
kpid=$!
timeout "$T1" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -q -rfE \
    tests/engine/test_gpu_engine.py >"$OUT/tests_engine.log" 2>&1
erc=$?
wait "$kpid"
krc=$?
echo "tests: kernels rc=$krc engine rc=$erc in $(($(date +%s) - start)) s"
for f in tests_kernels tests_engine; do
    grep -E "passed|failed|error" "$OUT/$f.log" | tail -1
    grep -E "^(FAILED|ERROR)|Error" "$OUT/$f.log" | head -8
done

start=$(date +%s)
timeout "$T2" python3 -m batchgen.bench.kernels --only moonlight --tokens 1,8,64 --no-linear \
    --tune --tuned-dir "$OUT/configs" >"$OUT/bench_kernels.log" 2>&1
echo "bench kernels rc=$? in $(($(date +%s) - start)) s"
grep -vE "^  skip" "$OUT/bench_kernels.log" | tail -14
[[ -f "$OUT/configs/fused_moe.json" ]] && cp "$OUT/configs/fused_moe.json" kernels/triton/configs/

start=$(date +%s)
args=("$@")
[[ ${#args[@]} -eq 0 ]] && args=(--hf-batches "" --batches 1,32,128,256)
timeout "$T3" python3 -m batchgen.bench.decode_moe "${args[@]}" >"$OUT/bench_decode.log" 2>&1
echo "bench decode rc=$? in $(($(date +%s) - start)) s"
grep -E "profile|tok/s|batchgen|roofline" "$OUT/bench_decode.log" | tail -24
rm -rf /tmp/batchgen-bench
