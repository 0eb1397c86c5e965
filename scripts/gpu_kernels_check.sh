#!/usr/bin/env bash
# One GPU call for the Triton kernels: the kernel tests at real sizes (no interpreter), then
# `bench kernels`. Logs and JSON land in $OUT (the device tool's folder) or /tmp/gpu_out.
#   scripts/gpu_kernels_check.sh            tests + bench with the committed config tables
#   scripts/gpu_kernels_check.sh --tune     tests + bench that also sweeps configs and writes
#                                           $OUT/configs/{fused_moe,fp8_linear}.json
#   BENCH_ONLY=v4 scripts/gpu_kernels_check.sh   restrict the bench to matching cases
#   SKIP_BENCH=1 ... runs the tests only
# Runs with the image's python3 and PYTHONPATH=. (no pip installs on the GPU machine).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 BATCHGEN_BENCH_DIR="$OUT"
TESTS_TIMEOUT=${TESTS_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
    --format=csv >"$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name())" 2>&1 | tee "$OUT/versions.txt"

# TESTS="tests/kernels/test_x.py ..." runs a subset (a call after a change to one kernel).
all_tests="tests/kernels/test_fp8_linear.py tests/kernels/test_fused_moe.py
    tests/kernels/test_rmsnorm_rope.py tests/kernels/test_moe_router.py
    tests/kernels/test_mla_decode.py tests/kernels/test_sampling.py"
read -r -a tests <<<"$(echo ${TESTS:-$all_tests})"
start=$(date +%s)
timeout "$TESTS_TIMEOUT" python3 -m pytest -o addopts="" -p no:cacheprovider -m "not slow" \
    -q -rfE --timeout 120 "${tests[@]}" >"$OUT/tests.log" 2>&1
echo "tests rc=$? in $(($(date +%s) - start)) s"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30

[[ -n "${SKIP_BENCH:-}" ]] && exit 0
start=$(date +%s)
args=()
[[ "${1:-}" == "--tune" ]] && args+=(--tune --tuned-dir "$OUT/configs")
[[ -n "${BENCH_ONLY:-}" ]] && args+=(--only "$BENCH_ONLY")
timeout "$BENCH_TIMEOUT" python3 -m batchgen.bench.kernels "${args[@]}" >"$OUT/bench.log" 2>&1
echo "bench rc=$? in $(($(date +%s) - start)) s"
grep -vE "^  skip" "$OUT/bench.log" | tail -60
