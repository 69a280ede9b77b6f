#!/usr/bin/env bash
# What a lent GPU runs, as one script (docs/benchmarks.md): the draft bench at GPT-OSS-20B's
# head shapes (EAGLE-3 chains of 1 and 4 layers, the 4-layer P-EAGLE head the recipes ship;
# bf16, eager and CUDA-graph replays, the planner's draft terms fitted for the card), then
# the CUDA tests. Everything lands in the folder given (default runs/gpu-checks).
#
#   bash scripts/gpu_checks.sh [OUT_DIR]
# Environment: PYTHON (python3), BENCH_TIMEOUT (300 s), TESTS_TIMEOUT (360 s), BENCH_BATCH
# ("1 8 32"), BENCH_ROUNDS (30). pytest runs with -P: the checkout's eyas/ must not shadow
# the installed package.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu-checks}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.csv"
echo "=== bench_draft"
timeout "${BENCH_TIMEOUT:-300}" "$py" scripts/bench_draft.py --device cuda --dtype bfloat16 \
  --target openai/gpt-oss-20b --layers 4 --shipped-layers 4 --batch ${BENCH_BATCH:-1 8 32} --prefix 2048 \
  --ks 3 5 7 --rounds ${BENCH_ROUNDS:-30} --warmup 3 --cuda-graphs --hardware auto --out "$out/bench_draft_gpt-oss-20b.json" \
  > "$out/bench_draft.log" 2>&1
echo "bench_draft exit $?"; tail -5 "$out/bench_draft.log"
echo "=== CUDA tests"
timeout "${TESTS_TIMEOUT:-360}" "$py" -P -m pytest -m cuda tests/e2e/test_cuda.py -q -p no:cacheprovider \
  > "$out/test_cuda.log" 2>&1
echo "tests exit $?"; tail -25 "$out/test_cuda.log"
