#!/usr/bin/env bash
# One GPU call for a change to the decode step's kernels, within ~9 minutes:
#   1. correctness, in parallel (neither is timed): the kernel tests at real sizes and the
#      gpu-marked engine tests (GPU greedy/logits against the CPU path, async scheduling);
#   2. `bench kernels` on $KBENCH_ONLY (default: the Moonlight MXFP4 fused MoE), tuning
#      its decode shapes; the merged config tables are installed into kernels/triton/configs/
#      for step 3 and come back in $OUT/configs;
#   3. `bench decode-moe` without transformers (its numbers are in the JSON already).
# Each stage logs to $OUT and later stages run even if an earlier one fails.
#   scripts/gpu_step_check.sh [decode-moe options, default --hf-batches "" --batches 1,8,32,128,256]
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 BATCHGEN_BENCH_DIR="$OUT"
T1=${TESTS_TIMEOUT:-120}
T2=${KBENCH_TIMEOUT:-150}
T3=${DECODE_TIMEOUT:-330}
KBENCH_ONLY=${KBENCH_ONLY:-moonlight-mxfp4}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used \
    --format=csv >"$OUT/nvidia-smi.txt" 2>&1
start=$(date +%s)
timeout "$T1" python3 -m pytest -o addopts="" -p no:cacheprovider -m "not slow" -q -rfE \
    tests/kernels/test_fused_moe.py tests/kernels/test_rmsnorm_rope.py \
    tests/kernels/test_fp8_linear.py tests/kernels/test_moe_router.py \
    tests/kernels/test_mla_decode.py tests/kernels/test_sampling.py \
    >"$OUT/tests_kernels.log" 2>&1 &
kpid=$!
timeout "$T1" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -q -rfE \
    tests/engine/test_gpu_engine.py >"$OUT/tests_engine.log" 2>&1
erc=$?
wait "$kpid"
krc=$?
echo "tests: kernels rc=$krc engine rc=$erc in $(($(date +%s) - start)) s"
for f in tests_kernels tests_engine; do
    grep -E "passed|failed|error" "$OUT/$f.log" | tail -1
    grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -12
done

if [[ "$T2" -gt 0 ]]; then
    start=$(date +%s)
    timeout "$T2" python3 -m batchgen.bench.kernels --only "$KBENCH_ONLY" --no-linear \
        --tune --tuned-dir "$OUT/configs" >"$OUT/bench_kernels.log" 2>&1
    echo "bench kernels rc=$? in $(($(date +%s) - start)) s"
    grep -vE "^  skip" "$OUT/bench_kernels.log" | tail -14
    [[ -f "$OUT/configs/fused_moe.json" ]] && cp "$OUT/configs/fused_moe.json" kernels/triton/configs/
fi

start=$(date +%s)
args=("$@")
[[ ${#args[@]} -eq 0 ]] && args=(--hf-batches "" --batches 1,8,32,128,256)
timeout "$T3" python3 -m batchgen.bench.decode_moe "${args[@]}" >"$OUT/bench_decode.log" 2>&1
echo "bench decode rc=$? in $(($(date +%s) - start)) s"
grep -E "tok/s|Error|error" "$OUT/bench_decode.log" | grep -v profile | tail -24
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in pathlib.Path(sys.argv[1]).glob("decode-*.json"):
    info = json.loads(f.read_text()).get("engine_info", {})
    for w, i in info.items():
        for k, p in i.items():
            if k.startswith("profile"):
                g = p.get("graph", {})
                print(w, k, "kernels", g.get("device_kernels_per_step"), "step", g.get("step_ms"),
                      "replay", g.get("replay_ms"), "host busy", g.get("host_busy_ms"))
                print("  ", {n[:40]: v for n, v in list(g.get("top_kernels_us", {}).items())[:12]})
PY
rm -rf /tmp/batchgen-bench
