#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Our Python test suites against a sanitized build of the extension:
#
#   bash tools/sanitize.sh address tests/unit tests/rpc
#   bash tools/sanitize.sh thread tests/unit/test_loop.py
#
# The fuzzers (tests/fuzz) cover the parsers a peer reaches; this covers
# the rest of the core (agent, transports, channels, the fake-driver CUDA
# path) under real traffic between processes. A sanitized extension needs
# its runtime first in every process that loads it, and Python does not
# link it, so the tree gets a build of its own (build/sanitize-KIND, a copy
# of this checkout's sources, tools/sync_tree.py, with its own .venv, as
# tools/with_torch.sh does for another torch; that .venv borrows this
# checkout's packages where it can: tools/setup_env.sh) and every process the tests
# start inherits LD_PRELOAD (tools/sanitizer_env.sh). A finding goes to
# build/sanitize-KIND/reports/KIND.PID (the runtime's log_path), whichever
# process it was in, and the run fails naming those files. Tests whose
# subject is what the sanitizer changes (memory bounds, a deliberate fault,
# a library that must crash unless libstdc++ is preloaded) skip themselves
# there (`not_sanitized` in pyproject.toml's markers). The first run builds
# the whole extension (~2 min on 2 cores, each source folder one unity
# unit); later ones rebuild what changed. SANITIZE_BUILD_ONLY=1 stops after
# the build (TORCH_RPC_EXT_TSAN=1 bash tools/test.sh builds the tree in the
# background that way, then runs stages 6 and 7 under it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$#" -lt 1 ] || { [ "$1" != address ] && [ "$1" != thread ]; }; then
  echo "usage: bash tools/sanitize.sh address|thread [PYTEST_ARGS...]" >&2
  exit 2
fi
kind=$1
shift
[ "$#" -gt 0 ] || set -- tests/unit
tree=build/sanitize-$kind
python3 tools/sync_tree.py "$tree" >&2
# Its .venv borrows this checkout's packages when they are the ones it
# needs (tools/setup_env.sh): the same torch, a build of its own.
export TORCH_RPC_EXT_BORROW_VENV=$PWD/.venv
cd "$tree"
export SANITIZE=$kind
SETUP_FOR=test . tools/setup_env.sh
if [ "${SANITIZE_BUILD_ONLY:-0}" = 1 ]; then
  echo "sanitize.sh: $tree built with the $kind sanitizer" >&2
  exit 0
fi
. tools/sanitizer_env.sh
reports=$PWD/reports
rm -rf "$reports"
mkdir -p "$reports"
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}log_path=$reports/address"
export TSAN_OPTIONS="${TSAN_OPTIONS:+$TSAN_OPTIONS:}log_path=$reports/thread"
export DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=${DISTRIBUTED_TESTS_DEFAULT_TIMEOUT:-600}
status=0
python -m pytest -p no:cacheprovider -q --timeout 1800 "$@" || status=$?
if compgen -G "$reports/*" >/dev/null; then
  echo "tools/sanitize.sh: the $kind sanitizer reported (files below); the first lines of each:" >&2
  for f in "$reports"/*; do
    echo "== $f" >&2
    head -n 30 "$f" >&2
  done
  [ "$status" -ne 0 ] || status=1
fi
exit "$status"
