#!/usr/bin/env bash
# GPU check of the Pallas (Triton) column-step kernel, about 3 minutes on one
# H100/H200: does it compile for the GPU, is it bit for bit the reference
# there, and how fast is it against lax.top_k and the reference step.
#
#   OUT=results_dir PYTHON=python3 bash benchmarks/gpu_kernel.sh
#
# Writes $OUT/gpu_kernel.txt (default OUT=./gpu_results). Sections:
# 1. "compile": each shape compiled for the GPU (Triton lowering + PTX), or
#    the error; 2. "bitwise": kernel == reference on the GPU for hard
#    gradients (ties, zeros, subnormal, wide, huge, NaN/Inf), f32 and bf16,
#    k in {1, 2, 16}, r in {1, 2}, chained steps (a mismatch in "subnormal" or
#    "normal" alone points at FMA contraction or flushing in Triton);
# 3. "time": ms per call of lax.top_k(|x|, k) alone, the reference step and
#    the kernel step on SmolLM2-135M's stacked shapes, bf16, k=16, r=1, with
#    a sweep of the tile size (rows per program); last line
#    kernel_over_topk and kernel_over_reference (sums of ms over the shapes)
#    at the best tile.
# SMOKE=1 runs the same script in interpret mode on CPU with small shapes (a
# check of the script itself, no figures). Run from the repository root.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"

gpu_header | tee "$OUT/gpu_kernel.txt"

timeout "${LIMIT_S:-300}" "$PY" -m tests.support.gpu_kernel_check \
  "${SMOKE:-0}" 2>&1 |
  grep -v -i warning | tee -a "$OUT/gpu_kernel.txt"
echo "results in $OUT/gpu_kernel.txt"
