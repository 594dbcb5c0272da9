#!/usr/bin/env bash
# GPU run of the taco_optax benchmarks, bounded to about 8 minutes on one
# H100/H200 (each step has its own timeout; a failed step does not stop the
# rest).
#
#   OUT=results_dir PYTHON=python3 bash benchmarks/gpu.sh
#
# Writes under $OUT (default ./gpu_results): env.txt (date, device, versions),
# memory_measured.jsonl (one JSON line per path: device peak_bytes_in_use and
# tokens/s of the full train step, each path in its own process because the
# peak only grows), step_time.txt (update-only times), memory_compiled.txt
# (XLA's compiled analysis on the GPU backend). Needs jax with CUDA, flax and
# optax in $PYTHON; run from the repository root.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"

{
  gpu_header
  "$PY" -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__); print(jax.devices())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

run() {  # run <seconds> <log> <command...>: bounded, never stops the script
  local limit=$1 log=$2; shift 2
  echo "== $*" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | grep -v -i warning | tee -a "$log"
}

# 1. Peak device memory and tokens/s of the whole train step, SmolLM2-135M
#    shapes, bf16, batch 4 x 256, layers scanned (about 3 minutes).
for path in forward "taco layerwise" taco adamw; do
  echo "== memory --execute $path" | tee -a "$OUT/memory_measured.log"
  timeout 90 "$PY" -m benchmarks.memory --execute "$path" --dtype bfloat16 \
    --batch 4 --seq 256 --steps 10 > "$OUT/memory_one.txt" 2>> "$OUT/memory_measured.log"
  tail -1 "$OUT/memory_one.txt" | tee -a "$OUT/memory_measured.jsonl"
done
rm -f "$OUT/memory_one.txt"

# 2. Update-only step time on a Llama-125M tree, bf16 (about 2 minutes).
run 150 "$OUT/step_time.txt" "$PY" -m benchmarks.step_time --model llama-125m --repeats 10

# 3. Compiled memory analysis on the GPU backend, bf16, scanned (about 1 minute).
run 100 "$OUT/memory_compiled.txt" "$PY" -m benchmarks.memory --dtype bfloat16 --skip-unrolled
echo "results in $OUT"
