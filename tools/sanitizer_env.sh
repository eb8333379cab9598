# SPDX-License-Identifier: BSD-3-Clause
# Sourced (tools/sanitize.sh, tools/setup_env.sh): with SANITIZE=address or
# thread, what a process needs to load an extension built so (setup.py's
# SANITIZE): the runtime first (Python does not link it), then libstdc++,
# which Python does not link either: without it the runtime finds no
# __cxa_throw to intercept at start-up and the first C++ exception aborts
# the process ("CHECK failed ... real___cxa_throw"). Every process the
# tests start inherits it. Without SANITIZE, nothing.
if [ -n "${SANITIZE:-}" ]; then
  case "$SANITIZE" in
    address) runtime=libasan.so ;;
    thread) runtime=libtsan.so ;;
    *)
      echo "sanitizer_env.sh: SANITIZE is address or thread, not '$SANITIZE'" >&2
      return 2
      ;;
  esac
  runtime=$("${CXX:-g++}" -print-file-name="$runtime")
  stdcxx=$("${CXX:-g++}" -print-file-name=libstdc++.so)
  export LD_PRELOAD="$runtime $(readlink -f "$stdcxx")${LD_PRELOAD:+ $LD_PRELOAD}"
  # Python and torch keep memory for the life of the process, which a leak
  # check would report by the thousand.
  export ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
  # Multi-process tests fork from a pytest process that has threads
  # (torch's, ours), as users' programs do; TSan would end the child.
  # tools/tsan.supp: torch's side of the races its uninstrumented atomics
  # make TSan see.
  export TSAN_OPTIONS="die_after_fork=0:suppressions=$(readlink -f tools/tsan.supp)${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
  # TSan cannot see the barriers of an uninstrumented libgomp, and reports
  # every parallel torch kernel as racing with its caller.
  if [ "$SANITIZE" = thread ]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  fi
  unset runtime stdcxx
fi
