#!/usr/bin/env bash
# Run on the GPU device from the repository root, with the peers' sources in .peers/ (git-ignored;
# how to make it: docs/experiments/2026-12-02-peers.md, "Making `.peers/`"):
#
#     [CP_PEERS_SKIP=flashmla] bash tools/run_with_peers.sh COMMAND [ARGS...]
#
# 1. Builds the peers from .peers/ with `tools/build_peers.py .peers --warm` into $CP_PEERS_SITE
#    (default /tmp/peers_site, exported, so bench_peers and the probes find it), logs in
#    $CP_PEERS_LOGS (default /tmp/peers_logs). CP_PEERS_SKIP (e.g. flashmla, or
#    flashmla,flashinfer) is passed as --skip.
# 2. Runs COMMAND with the peers' site on PYTHONPATH and the repository root too.
# 3. With $OUT set, copies the build logs, nvidia-smi and the versions to $OUT/peers-build/
#    (after the build, and again after the command).
# Exit status: the command's (a failed build step is logged and the command still runs).
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
T0=$(date +%s)
export CP_PEERS_SITE="${CP_PEERS_SITE:-/tmp/peers_site}"
LOGS="${CP_PEERS_LOGS:-/tmp/peers_logs}"
JOBS="${CP_PEERS_JOBS:-$(nproc)}"
mkdir -p "$CP_PEERS_SITE" "$LOGS"
PY=python3

copy_out() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT/peers-build"
    cp -f "$LOGS"/*.txt "$LOGS"/*.log "$OUT/peers-build/" 2>/dev/null || true
}

{
    echo "# env (nvidia-smi, nvcc, torch/triton, ncu)"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
    nvcc --version 2>&1 | tail -1
    $PY -c "import torch, triton; print(torch.__version__, triton.__version__)" 2>&1
    command -v ncu || echo "ncu: not found"
    echo
    nvidia-smi 2>&1
} > "$LOGS/env.txt"

SKIP=()
[ -n "${CP_PEERS_SKIP:-}" ] && SKIP=(--skip "$CP_PEERS_SKIP")
echo "# $PY tools/build_peers.py $REPO/.peers --warm --site $CP_PEERS_SITE --logs $LOGS" \
    "--jobs $JOBS ${SKIP[*]:-}" > "$LOGS/build.txt"
$PY tools/build_peers.py "$REPO/.peers" --warm --site "$CP_PEERS_SITE" --logs "$LOGS" \
    --jobs "$JOBS" ${SKIP[@]+"${SKIP[@]}"} 2>&1 | tee -a "$LOGS/build.txt"
BUILD_RC=${PIPESTATUS[0]}
echo "build rc=$BUILD_RC at $(( $(date +%s) - T0 )) s" | tee -a "$LOGS/build.txt"

PYTHONPATH="$CP_PEERS_SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" $PY - >> "$LOGS/env.txt" 2>&1 <<'EOF'
import importlib
for name in ("flashinfer", "tvm_ffi", "flash_mla"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        print(name, "unavailable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
EOF
copy_out

[ $# -eq 0 ] && exit "$BUILD_RC"
export PYTHONPATH="$CP_PEERS_SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$@"
RC=$?
echo "command rc=$RC at $(( $(date +%s) - T0 )) s" | tee -a "$LOGS/build.txt"
copy_out
exit "$RC"
