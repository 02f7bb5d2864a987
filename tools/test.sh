#!/usr/bin/env bash
# Set up .venv if needed, then run the CPU test suite (Triton kernels under the interpreter,
# distributed code on spawned gloo processes). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
if ! .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export TRITON_INTERPRET=1
fi
exec .venv/bin/python -m pytest "$@"
