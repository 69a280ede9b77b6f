#!/usr/bin/env bash
# The test command: set up (or reuse) the virtual environment, lint (ruff), then run pytest.
#   scripts/test.sh               the fast suite (15-19 min on 2 cores), then the slow end-to-end tests
#                                 (real SmolLM2, SIGKILL/resume, DDP and DeepSpeed launches, and
#                                 the real vLLM of .venv-vllm, set up here: regeneration through
#                                 `vllm serve`, heads served with eyas's acceptance)
#   EYAS_TEST_FAST=1 scripts/test.sh   the fast suite only
#   EYAS_TEST_VLLM=0 scripts/test.sh   both tiers, without setting up or running vLLM
#   scripts/test.sh -m slow       pytest arguments of your own (here: only the slow tests)
# Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh || { echo "environment setup failed" >&2; exit 1; }
VENV=${EYAS_VENV:-.venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline

run_pytest() {
  "$VENV/bin/python" -m pytest "$@"
  rc=$?
  # pytest exits 5 when a selection holds no test: not a failure of the code.
  [ $rc -eq 5 ] && rc=0
  return $rc
}

if [ $# -gt 0 ]; then
  run_pytest "$@"; exit $?
fi
# Lint and format first: seconds, and a failure names the file and line.
"$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check . || {
  echo "ruff: run '$VENV/bin/ruff format . && $VENV/bin/ruff check --fix .'" >&2; exit 1; }
# --durations: the slowest tests of each tier in the log, where the CI time goes
run_pytest -m "not slow and not vllm and not cuda" -q --durations=15
rc=$?
if [ $rc -eq 0 ] && [ "${EYAS_TEST_FAST:-0}" != "1" ]; then
  slow="slow and not cuda"
  if [ "${EYAS_TEST_VLLM:-1}" = "0" ]; then
    slow="$slow and not vllm"
  else
    scripts/setup_vllm_env.sh || { echo "vLLM environment setup failed (EYAS_TEST_VLLM=0 skips it)" >&2; exit 1; }
  fi
  run_pytest -m "$slow" -q --durations=15
  rc=$?
fi
exit $rc
