#!/usr/bin/env bash
# GPU run of the taco_optax benchmarks (about 10 minutes on one H100/H200).
#
#   OUT=results_dir PYTHON=python3 bash benchmarks/gpu.sh
#
# Writes under $OUT (default ./gpu_results): env.txt (date, device, versions),
# step_time.txt, memory_compiled.txt, memory_measured.jsonl (one JSON line per
# path and layout: device peak_bytes_in_use and tokens/s, each path in its own
# process because the peak only grows), planner.txt. Needs jax with CUDA,
# flax and optax in $PYTHON; run from the repository root.
set -uo pipefail
OUT=${OUT:-gpu_results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  "$PY" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__); print(jax.devices())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

run() {  # run <seconds> <log> <command...>: bounded, never stops the script
  local limit=$1 log=$2; shift 2
  echo "== $*" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | grep -v -i warning | tee -a "$log"
}

# 1. Update-only step time (about 2 minutes).
for model in llama-125m llama-350m; do
  run 150 "$OUT/step_time.txt" "$PY" benchmarks/step_time.py --model "$model" --repeats 10
done

# 2. Memory: compiled analysis on the GPU backend, bf16 (about 2 minutes).
run 240 "$OUT/memory_compiled.txt" "$PY" benchmarks/memory.py --dtype bfloat16

# 3. Memory and speed measured on the device (about 4 minutes).
for layout in "" "--unrolled"; do
  for path in forward adamw taco "taco layerwise"; do
    timeout 120 "$PY" benchmarks/memory.py --execute "$path" $layout \
      --dtype bfloat16 --batch 4 --seq 256 --steps 10 2>/dev/null \
      | tail -1 | tee -a "$OUT/memory_measured.jsonl"
  done
done

# 4. Planner against the paper's Table 5 (seconds).
run 120 "$OUT/planner.txt" "$PY" benchmarks/planner.py --batch 4 --seq 128 --gpu-gb 80
echo "results in $OUT"
