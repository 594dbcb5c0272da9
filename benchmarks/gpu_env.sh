# Sourced by the GPU scripts (gpu.sh, gpu_kernel.sh): where results go, which
# Python runs, the environment every step shares, and a header saying what
# the figures were measured on. Run from the repository root.
OUT=${OUT:-gpu_results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false

gpu_header() {  # date, commit and device, one item a line
  date -u +%Y-%m-%dT%H:%M:%SZ
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
}
