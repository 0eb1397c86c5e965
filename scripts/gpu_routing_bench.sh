#!/usr/bin/env bash
# `bench routing` at full Moonlight-16B-A3B shapes on the GPU box: arrival vs planned order
# with clusters computed on a dev machine (the GPU image has no embedding model), carried in
# data/tasks/mixed_tasks_assignments.parquet. Needs pydantic wheels carried in .whl/.
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
time python3 -c "
from engine.checkpoint_maker import make_random_checkpoint
make_random_checkpoint('/tmp/moonlight', preset='moonlight-16b-a3b', seed=1, device='cuda')
" 2>&1 | tee "$OUT/make.log"
time python3 -m batchgen bench routing --model /tmp/moonlight \
  --input data/tasks/mixed_tasks.parquet --assignments data/tasks/mixed_tasks_assignments.parquet \
  --batch 64 --max-tokens 16 --device cuda --dtype bfloat16 --name routing-h200-moonlight \
  2>&1 | tee "$OUT/routing.log"
cp data/benchmarks/routing-h200-moonlight.json "$OUT/" 2>/dev/null
