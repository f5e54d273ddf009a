#!/usr/bin/env bash
# Every GPU check in one call, for a lent machine: the smoke test (kernels, step table at 17M and 100M,
# sync-debug, graph replay, profiles), then the Lightning fits.
#   bash benchmarks/gpu_run.sh OUTDIR [SMOKE_ARGS...]
# Wheels under .whl/ (e.g. a numpy that the machine's numba-cuda compiles with) are installed first.
set -u
OUT=${1:-gpu_out}; shift || true
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
t0=$(date +%s)
timeout "${SMOKE_TIMEOUT:-330}" python3 benchmarks/gpu_smoke.py --out "$OUT/gpu_smoke.md" --trace "$OUT/trace.json" "$@" \
  >"$OUT/smoke.log" 2>&1
echo "gpu_smoke rc=$? in $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout "${FIT_TIMEOUT:-150}" python3 benchmarks/gpu_fit.py --out "$OUT/gpu_fit.md" >"$OUT/fit.log" 2>&1
echo "gpu_fit rc=$? in $(( $(date +%s) - t1 )) s"
grep -E "^  (FAIL|ok   (environment|NaN|DiLoCo)|info (step|profile|OnebitAdam|graph|host|throughput))" "$OUT/smoke.log" | cut -c1-300
grep -E "failed check" "$OUT/smoke.log"
tail -n 4 "$OUT/smoke.log" | cut -c1-300
grep -E "^  (ok|FAIL|info)" "$OUT/fit.log" | cut -c1-220
tail -n 3 "$OUT/fit.log" | cut -c1-300
