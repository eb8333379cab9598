#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# A bounded fuzzing round: builds the targets (build.sh), then runs each for
# a fixed time (or number of executions) from its seed corpus
# (corpus/<target>/). Exits non-zero if any target reports a finding (crash,
# sanitizer report, leak, timeout, OOM). CI runs it once from tools/test.sh.
#
#   bash tests/fuzz/run.sh                # every target, ~60 s in total
#   bash tests/fuzz/run.sh -s 30 codec    # 30 s of one target
#   bash tests/fuzz/run.sh -r 5000000 ring  # a campaign: 5M executions
#
# Inputs the round discovers go to a scratch corpus under build/ (the seed
# corpus is only read); a finding's input is saved as
# build/artifacts/<target>-crash-<sha1> (or leak-, timeout-, oom-).
# Replay one: tests/fuzz/build/fuzz_<target> <file>.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

total=${FUZZ_TOTAL_SECONDS:-60}
per=""
runs=""
while getopts "s:r:" opt; do
  case $opt in
    s) per=$OPTARG ;;
    r) runs=$OPTARG ;;
    *) echo "usage: $0 [-s seconds | -r runs] [target...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(bash "$here/build.sh" --list)
fi
[ -n "$per" ] || per=$(( (total + ${#targets[@]} - 1) / ${#targets[@]} ))

bash "$here/build.sh" "${targets[@]}"

# Findings are fatal and reported with a stack: ASan (leaks included: LSan
# works in this sandbox), UBSan (-fno-sanitize-recover=undefined at build
# time, and halt_on_error). Options already in the environment come last and
# so override these.
asan=(detect_leaks=1 detect_stack_use_after_return=1
  check_initialization_order=1 strict_init_order=1 strict_string_checks=1
  handle_abort=1 allocator_may_return_null=0 symbolize=1)
ubsan=(halt_on_error=1 print_stacktrace=1 symbolize=1)
ASAN_OPTIONS="$(IFS=:; echo "${asan[*]}")${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
UBSAN_OPTIONS="$(IFS=:; echo "${ubsan[*]}")${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export ASAN_OPTIONS UBSAN_OPTIONS

# The stream target fuzzes cuda_ipc too, against the fake driver of
# tests/cuda_fake, always (a real driver refuses a process its own IPC
# handles; a failure to build the fake is a failure: it needs only cuda.h
# and g++, as the target).
root=$(cd "$here/../.." && pwd)
if [[ " ${targets[*]} " == *" stream "* ]]; then
  py=python3
  [ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"
  TORCH_RPC_EXT_LIBCUDA=$(cd "$root" && "$py" -c \
    'from tests.cuda_fake import build; print(build())')
  export TORCH_RPC_EXT_LIBCUDA
fi
# The harness plays both ends of cuda_ipc in one process.
export FAKE_CUDA_IPC_SELF=1

out="$here/build"
mkdir -p "$out/artifacts"
failed=()
start=$(date +%s)
for t in "${targets[@]}"; do
  work="$out/round-corpus/$t"
  rm -rf "$work"
  mkdir -p "$work"
  log="$out/round-$t.log"
  if [ -n "$runs" ]; then
    bound=(-runs="$runs")
    echo "fuzzing $t for $runs executions"
  else
    bound=(-max_total_time="$per")
    echo "fuzzing $t for ${per} s"
  fi
  t0=$(date +%s)
  for try in 1 2; do
    rc=0
    "$out/fuzz_$t" "${bound[@]}" -timeout=30 -rss_limit_mb=4096 \
      -print_final_stats=1 -artifact_prefix="$out/artifacts/$t-" \
      "$work" "$here/corpus/$t" >"$log" 2>&1 || rc=$?
    # LeakSanitizer's own tracer crashing (its stop-the-world thread caught
    # a signal; docs/reliability.md) is the sanitizer failing, not a
    # finding: when that is the log's only report, the target runs once
    # more, said here, its log kept. Twice is a failure like any other.
    if [ "$rc" -ne 0 ] && [ "$try" -eq 1 ] &&
      grep -q 'LeakSanitizer has encountered a fatal error' "$log" &&
      grep -q 'Tracer caught signal' "$log" &&
      ! grep -q -E 'ERROR: (AddressSanitizer|LeakSanitizer: detected)|runtime error|FUZZ FINDING|ALARM' "$log"; then
      cp "$log" "$out/round-$t.tracer-crash.log"
      echo "  $t: LeakSanitizer's tracer crashed (not a finding; log in" \
        "$out/round-$t.tracer-crash.log): running it once more"
      continue
    fi
    break
  done
  final=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  echo "  $t: rc=$rc execs=${execs:-?} in $(( $(date +%s) - t0 )) s; ${final#*DONE}"
  if [ "$rc" -ne 0 ]; then
    failed+=("$t")
    echo "---- $t: finding (log $log) ----"
    grep -E -A40 'ERROR:|FUZZ FINDING|runtime error|deadly signal|ALARM' "$log" |
      head -80 || tail -40 "$log"
  fi
done
echo "fuzz round: ${#targets[@]} targets in $(( $(date +%s) - start )) s"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz round FAILED: findings in ${failed[*]} (inputs in $out/artifacts/)" >&2
  exit 1
fi
echo "fuzz round: no findings"
