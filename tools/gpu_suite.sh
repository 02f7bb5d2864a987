#!/usr/bin/env bash
# Run on a CUDA machine from the repository root: the GPU test tier, then the kernel and module
# benchmark suite (python -m benchmarks.suite). Logs, results and the report go to ${OUT:-gpu_out}. Usage: tools/gpu_suite.sh [tests|bench|all]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c 'import hydra' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
what=${1:-all}
rc=0
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest tests -m gpu -q -p no:cacheprovider --timeout 600 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || rc=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m benchmarks.suite ${SUITE_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v -i warn | tail -60 || rc=1
  tar czf "$OUT/results.tgz" benchmarks/results benchmarks/20*.* 2>/dev/null
fi
exit $rc
