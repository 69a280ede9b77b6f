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
LOGS=runs/bench_logs
mkdir -p "$(dirname "$OUT")" "$LOGS"
for bench in scripts/bench_*.py; do
  name=$(basename "$bench" .py)
  echo "running $name ..." >&2
  "$PY" "$bench" > "$LOGS/$name.json" 2> "$LOGS/$name.err"
  echo $? > "$LOGS/$name.rc"
done
"$PY" - "$LOGS" "$OUT" <<'PY'
import json, sys
from pathlib import Path
logs, out = Path(sys.argv[1]), Path(sys.argv[2])
merged = {}
for rc_file in sorted(logs.glob("*.rc")):
    name, rc = rc_file.stem, int(rc_file.read_text())
    try:
        merged[name] = json.loads((logs / f"{name}.json").read_text()) if rc == 0 else None
    except json.JSONDecodeError:
        merged[name] = None
    if merged[name] is None:
        merged[name] = {"error": True, "exit_code": rc, "stderr_tail": (logs / f"{name}.err").read_text()[-400:]}
out.write_text(json.dumps(merged, indent=1) + "\n")
print(out.read_text())
PY
