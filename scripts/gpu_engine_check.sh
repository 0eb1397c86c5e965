#!/usr/bin/env bash
# One GPU call for the engine: the gpu-marked engine tests, then `bench decode-moe` (our
# engine on Moonlight-shaped random checkpoints in bf16 and FP8 + MXFP4, transformers on the
# bf16 one). Logs and JSON land in $OUT (the device tool's folder) or /tmp/gpu_out.
#   scripts/gpu_engine_check.sh [bench options]     e.g. --layers 4 --hf-batches ""
#   SKIP_TESTS=1 scripts/gpu_engine_check.sh        bench only (SKIP_BENCH=1: tests only)
# Runs with the image's python3 and PYTHONPATH=. (no pip installs on the GPU machine).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 BATCHGEN_BENCH_DIR="$OUT"
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-420}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used \
    --format=csv >"$OUT/nvidia-smi.txt" 2>&1
df -h /tmp >>"$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name()); \
import engine.llm, engine.backends.cuda, engine.cuda_graph_runner, batchgen.bench.decode_moe; \
print('engine imports ok')" 2>&1 | tee "$OUT/versions.txt"

if [[ -z "${SKIP_TESTS:-}" ]]; then
    start=$(date +%s)
    timeout "$TESTS_TIMEOUT" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -q -rfE \
        --timeout 140 tests/engine/test_gpu_engine.py >"$OUT/engine_tests.log" 2>&1
    echo "engine tests rc=$? in $(($(date +%s) - start)) s"
    grep -E "passed|failed|error" "$OUT/engine_tests.log" | tail -3
    grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/engine_tests.log" | head -20
fi

[[ -n "${SKIP_BENCH:-}" ]] && exit 0
start=$(date +%s)
timeout "$BENCH_TIMEOUT" python3 -m batchgen.bench.decode_moe "$@" >"$OUT/bench_decode.log" 2>&1
echo "bench rc=$? in $(($(date +%s) - start)) s"
tail -45 "$OUT/bench_decode.log"
rm -rf /tmp/batchgen-bench
