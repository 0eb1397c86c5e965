#!/usr/bin/env bash
# `batchgen bench ray --workers 1 --gpu` on the one-GPU machine: the same job on the local
# executor and on Ray with one GPU worker, so the table shows Ray's overhead there.
# The image has no Ray: carry the wheels `python scripts/ray_gpu_wheels.py` puts in .whl/
# (48 MiB). Logs and the JSON land in $OUT (the device tool's folder) or /tmp/gpu_out.
#   scripts/gpu_ray_bench.sh [bench options]    e.g. --rows 4000 --max-tokens 128
# MODEL=/path skips making the random Moonlight-shaped checkpoint (4 layers of real shapes).
set -u -o pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
# Ray's workers inherit the driver's environment, so they import the same packages.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BATCHGEN_BENCH_DIR="$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import ray, ray.data, pydantic, torch; print('ray', ray.__version__, 'torch', \
torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/versions.txt" || exit 1
MODEL=${MODEL:-/tmp/moonlight-4l}
if [[ ! -d "$MODEL" ]]; then
  time python3 -m batchgen models make-random --preset moonlight-16b-a3b --layers 4 \
    --device cuda "$MODEL" 2>&1 | tee "$OUT/make.log" || exit 1
fi
time timeout 480 python3 -m batchgen bench ray --workers 1 --gpu --model "$MODEL" \
  --rows 2000 --max-tokens 64 --max-num-seqs 256 --rows-per-part 250 "$@" 2>&1 \
  | tee "$OUT/bench.log"
