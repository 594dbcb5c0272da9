# Sourced by .ci/run: legs, timed and named, and the newest Python.
#
#   leg NAME      ends the leg before (printing its time) and starts NAME
#   leg_end       ends the current leg
#   in_background LOG CMD...  runs CMD in a process group of its own, its
#                 output to LOG; its pid is then in $ci_last_background
# On a non-zero exit (set -e) the EXIT trap prints the leg that was running,
# with its exit code, so a failure is reported by the leg it happened in, and
# stops what runs in the background.

ci_start=$(date +%s)
leg_name=
leg_start=
ci_background=()

leg() {
  leg_end
  leg_name=$1
  leg_start=$(date +%s)
  echo "===== leg: $leg_name"
}

leg_end() {
  if [ -n "$leg_name" ]; then
    echo "===== leg: $leg_name passed in $(( $(date +%s) - leg_start )) s"
  fi
  leg_name=
}

in_background() {
  local log=$1
  shift
  setsid "$@" > "$log" 2>&1 &
  ci_last_background=$!
  ci_background+=("$ci_last_background")
}

leg_failed() {
  local code=$? pid
  if [ "$code" -ne 0 ]; then
    for pid in "${ci_background[@]}"; do
      kill -- "-$pid" 2>/dev/null || true
    done
    echo "!!!!! CI FAILED in leg '${leg_name:-set-up}' with exit code" \
         "$code after $(( $(date +%s) - ci_start )) s !!!!!" >&2
  fi
}
trap leg_failed EXIT

# A Python 3.12+ interpreter for the newest stack: python3.13/3.12 on the
# PATH, else one of pyenv's; none: returns 1.
newest_python() {
  local candidate
  for candidate in "$(command -v python3.13 || true)" \
                   "$(command -v python3.12 || true)" \
                   $(if command -v pyenv >/dev/null; then
                       ls -d "$(pyenv root)"/versions/3.1[3-9]*/bin/python3 \
                             "$(pyenv root)"/versions/3.12*/bin/python3 \
                             2>/dev/null | sort -rV; fi); do
    if [ -n "$candidate" ] && "$candidate" -c \
        'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}
