#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# A bounded fuzzing round: builds the targets (build.sh), then runs each for
# a fixed time from its seed corpus (corpus/<target>/). Exits non-zero if any
# target reports a finding (crash, sanitizer report, leak, timeout, OOM).
# CI runs it once from tools/test.sh.
#
#   bash tests/fuzz/run.sh                # every target, ~60 s in total
#   bash tests/fuzz/run.sh -s 30 codec    # 30 s of one target
#
# Inputs the round discovers go to a scratch corpus under build/ (the seed
# corpus is only read); a finding's input is saved as
# build/artifacts/<target>-crash-<sha1> (or leak-, timeout-, oom-).
# Replay one: tests/fuzz/build/fuzz_<target> <file>.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

total=${FUZZ_TOTAL_SECONDS:-60}
per=""
while getopts "s:" opt; do
  case $opt in
    s) per=$OPTARG ;;
    *) echo "usage: $0 [-s seconds_per_target] [target...]" >&2; exit 2 ;;
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

# Findings are fatal and reported with a stack: ASan (leaks included),
# UBSan (-fno-sanitize-recover=undefined at build time, and halt_on_error).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:strict_string_checks=1:handle_abort=1:allocator_may_return_null=0:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:symbolize=1}

out="$here/build"
mkdir -p "$out/artifacts"
failed=()
start=$(date +%s)
for t in "${targets[@]}"; do
  work="$out/round-corpus/$t"
  rm -rf "$work"
  mkdir -p "$work"
  log="$out/round-$t.log"
  echo "fuzzing $t for ${per} s"
  rc=0
  "$out/fuzz_$t" -max_total_time="$per" -timeout=30 -rss_limit_mb=4096 \
    -print_final_stats=1 -artifact_prefix="$out/artifacts/$t-" \
    "$work" "$here/corpus/$t" >"$log" 2>&1 || rc=$?
  final=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  echo "  $t: rc=$rc execs=${execs:-?} ${final#*DONE}"
  if [ "$rc" -ne 0 ]; then
    failed+=("$t")
    echo "---- $t: finding (log $log) ----"
    grep -E -A40 'ERROR:|FUZZ FINDING|runtime error|deadly signal|ALARM' "$log" | head -80 || tail -40 "$log"
  fi
done
echo "fuzz round: ${#targets[@]} targets in $(( $(date +%s) - start )) s"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz round FAILED: findings in ${failed[*]} (inputs in $out/artifacts/)" >&2
  exit 1
fi
echo "fuzz round: no findings"
