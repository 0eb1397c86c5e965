#!/usr/bin/env bash
# One GPU call for a change to the decode step's kernels, within ~9 minutes:
#   1. correctness, in parallel (neither is timed): the kernel tests at real sizes and the
#      gpu-marked engine tests (GPU greedy/logits against the CPU path, async scheduling);
#   2. `bench kernels $KBENCH_ARGS` (default: tune the Moonlight MXFP4 fused MoE; several
#      runs separated by ';', $KBENCH_TIMEOUT each); the tuned tables are installed into
#      kernels/triton/configs/ for step 3;
#   3. `bench decode-moe` (default without transformers: its numbers are in the JSON).
# Each stage logs to $OUT and later stages run even if an earlier one fails. At the end the
# logs and the tuned tables are packed into $OUT/logs.tgz and $OUT/configs.tgz (the device
# tool brings back at most 8 files).
#   scripts/gpu_step_check.sh [decode-moe options, default --hf-batches "" --batches 1,8,32,128,256]
#
# Each device call starts on a fresh machine, and Triton compiles every kernel variant the
# tests and benchmarks launch again (the fused-MoE GPU tests alone can outrun 170 s). So
# Triton's cache travels: the script leaves it, without the IR text files, in
# $OUT/triton-cache.tgz (when under the 16 MiB a returned file may have); copy that file to
# the repo root (git ignores it) and name it in the next call's `carry`, and the script
# unpacks it first. Same code and image: the kernels load instead of compiling.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=/tmp/triton-cache  # one absolute path: the cache's index files hold it
mkdir -p "$TRITON_CACHE_DIR"
[[ -f .triton-cache.tgz ]] && tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR" &&
    echo "triton cache: $(find "$TRITON_CACHE_DIR" -name '*.json' ! -name '__grp__*' | wc -l) kernels carried in"
export PYTHONPATH=. PYTHONUNBUFFERED=1 BATCHGEN_BENCH_DIR="$OUT"
T1=${TESTS_TIMEOUT:-200}
T2=${KBENCH_TIMEOUT:-150}
T3=${DECODE_TIMEOUT:-330}
KBENCH_ARGS=${KBENCH_ARGS:---only moonlight-mxfp4 --no-linear --tune}
KTESTS=${KTESTS:-tests/kernels/test_fused_moe.py tests/kernels/test_rmsnorm_rope.py
    tests/kernels/test_fp8_linear.py tests/kernels/test_moe_router.py
    tests/kernels/test_mla_decode.py tests/kernels/test_sampling.py}
read -r -a ktests <<<"$(echo $KTESTS)"
LOGS="$OUT/logs"
mkdir -p "$LOGS"

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used \
    --format=csv 2>&1 | tail -1
start=$(date +%s)
timeout "$T1" python3 -m pytest -o addopts="" -p no:cacheprovider -m "not slow" -q -rfE \
    "${ktests[@]}" >"$LOGS/tests_kernels.log" 2>&1 &
kpid=$!
timeout "$T1" python3 -m pytest -o addopts="" -p no:cacheprovider -m gpu -q -rfE \
    tests/engine/test_gpu_engine.py >"$LOGS/tests_engine.log" 2>&1
erc=$?
wait "$kpid"
krc=$?
echo "tests: kernels rc=$krc engine rc=$erc in $(($(date +%s) - start)) s"
for f in tests_kernels tests_engine; do
    grep -E "passed|failed|error" "$LOGS/$f.log" | tail -1
    grep -E "^(FAILED|ERROR)" "$LOGS/$f.log" | head -12
done

# KBENCH_ARGS may hold several invocations separated by ';' (each its own JSON name and
# time limit share); each one's tuned tables are installed before the next.
if [[ "$T2" -gt 0 ]]; then
    IFS=';' read -r -a kruns <<<"$KBENCH_ARGS"
    n=0
    for run in "${kruns[@]}"; do
        read -r -a kbench <<<"$run"
        n=$((n + 1))
        start=$(date +%s)
        timeout "$T2" python3 -m batchgen.bench.kernels "${kbench[@]}" --name "kernels-h200-$n" \
            --tuned-dir "$OUT/configs" >"$LOGS/bench_kernels_$n.log" 2>&1
        echo "bench kernels [$run] rc=$? in $(($(date +%s) - start)) s"
        grep -vE "^  skip" "$LOGS/bench_kernels_$n.log" | grep -A 80 "^device-to-device" | head -80
        for f in "$OUT"/configs/*.json; do [[ -f "$f" ]] && cp "$f" kernels/triton/configs/; done
    done
fi

start=$(date +%s)
args=("$@")
[[ ${#args[@]} -eq 0 ]] && args=(--hf-batches "" --batches 1,8,32,128,256)
timeout "$T3" python3 -m batchgen.bench.decode_moe "${args[@]}" >"$LOGS/bench_decode.log" 2>&1
echo "bench decode rc=$? in $(($(date +%s) - start)) s"
grep -E "tok/s|Error|error" "$LOGS/bench_decode.log" | grep -v profile | tail -24
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in pathlib.Path(sys.argv[1]).glob("decode-*.json"):
    info = json.loads(f.read_text()).get("engine_info", {})
    for w, i in info.items():
        for k, p in i.items():
            if k.startswith("profile_prefill"):
                print(w, k, "wall ms", p.get("wall_ms"), "plain", p.get("plain_wall_ms"),
                      "kernel us", p.get("kernel_us"), "host op us", p.get("host_op_us"))
                for row in p.get("python_top", [])[:14]:
                    print("   py", row)
                print("   kernels", {n[:40]: v for n, v in list(p.get("top_kernels_us", {}).items())[:8]})
                print("   host", {n[:40]: v for n, v in list(p.get("top_host_ops_us", {}).items())[:8]})
                for op in p.get("device_ops", [])[:10]:
                    print("   device op", op["op"], op["device_us"], "us", op["calls"], "calls:",
                          " <- ".join(f.split("/")[-1] for f in op["stack"][:3]))
                for wait in p.get("waits", [])[:8]:
                    print("   wait", wait["op"], wait["self_us"], "us", wait["calls"], "calls:",
                          " <- ".join(f.split("/")[-1] for f in wait["stack"][:4]))
            elif k.startswith("profile"):
                g = p.get("graph", {})
                print(w, k, "kernels", g.get("device_kernels_per_step"), "step", g.get("step_ms"),
                      "replay", g.get("replay_ms"), "host busy", g.get("host_busy_ms"))
                print("  ", {n[:40]: v for n, v in list(g.get("top_kernels_us", {}).items())[:12]})
PY
rm -rf /tmp/batchgen-bench
tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
[[ -d "$OUT/configs" ]] && tar -czf "$OUT/configs.tgz" -C "$OUT" configs && rm -rf "$OUT/configs"
# Loading a cached kernel needs its metadata .json and its .cubin; the IR texts are ~90%
# of the bytes (a group index lists them, and Triton skips listed files that are gone).
find "$TRITON_CACHE_DIR" \( -name '*.ttir' -o -name '*.ttgir' -o -name '*.llir' -o -name '*.ptx' \
    -o -name '*.source' \) -delete
tar -czf "$OUT/triton-cache.tgz" -C "$TRITON_CACHE_DIR" .
size=$(stat -c %s "$OUT/triton-cache.tgz")
if [[ "$size" -gt $((16 << 20)) ]]; then
    echo "triton cache: $((size >> 20)) MiB, over what a call returns; not kept"
    rm -f "$OUT/triton-cache.tgz"
fi
ls "$OUT"
