#!/usr/bin/env bash
# Run every scripts/bench_*.py and write one JSON: {"<bench name>": <its JSON>, ...}.
#   bash scripts/bench_all.sh [OUT.json]      (default runs/bench_all.json)
# Each benchmark prints JSON on stdout; a failing one is recorded with its exit code and
# stderr tail instead of stopping the rest. Run it on a quiet machine: other jobs on the
# same cores change every timing.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/bench_all.json}
PY=${EYAS_PYTHON:-.venv/bin/python}
mkdir -p "$(dirname "$OUT")" runs/bench_logs
parts=()
for bench in scripts/bench_*.py; do
  name=$(basename "$bench" .py)
  echo "running $name ..." >&2
  if "$PY" "$bench" > "runs/bench_logs/$name.json" 2> "runs/bench_logs/$name.err"; then
    parts+=("\"$name\": $(cat "runs/bench_logs/$name.json")")
  else
    rc=$?
    err=$(tail -c 400 "runs/bench_logs/$name.err" | "$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read()))')
    parts+=("\"$name\": {\"error\": true, \"exit_code\": $rc, \"stderr_tail\": $err}")
  fi
done
{ echo "{"; (IFS=$'\n'; echo "${parts[*]}" | paste -sd, -); echo "}"; } | "$PY" -m json.tool > "$OUT"
echo "wrote $OUT" >&2
cat "$OUT"
