#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The test suite, on both ends of the torch range setup.py declares:
#   - on the oldest tested torch, the default (a CPU build, which the
#     fake-CUDA tests need): upstream's RPC conformance suites on
#     TORCH_RPC_EXT, our multi-process tests, the in-process unit tests,
#     then a bounded round of the libFuzzer targets;
#   - on the newest (NEWEST_TORCH, a CUDA build from the registry, run on
#     the CPU), in a tree of its own (tools/with_torch.sh), set up in the
#     background while the first torch's stages run: upstream's
#     conformance suites over TCP only, our multi-process tests and the
#     wheel.
# ThreadSanitizer's stages (our threads' meeting points, in process and
# between processes, and the CUDA path on the fake driver) run only when
# asked: TORCH_RPC_EXT_TSAN=1 adds them to the run, TORCH_RPC_EXT_TSAN=only
# runs them alone (docs/development.md, "The suites under a sanitizer").
# The stages run in three lanes at once (see second_lane below). Each says
# which torch it runs on, how long it took and the CPU it used; a table of
# the stages ends each lane, and a line with the whole run's CPU ends the run.
# Arguments, if any, are passed to a single pytest run instead (`bash
# tools/test.sh tests/rpc/test_exit.py`): with .venv set up, that reinstalls
# nothing and rebuilds only what changed. `bash tools/with_torch.sh 2.15.0
# bash tools/test.sh ARGS...` does the same against that torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NEWEST_TORCH=2.15.0
tsan=${TORCH_RPC_EXT_TSAN:-0}
case "$tsan" in
  0 | 1 | only) ;;
  *) echo "tools/test.sh: TORCH_RPC_EXT_TSAN is 0 (the default), 1 (add ThreadSanitizer's stages) or only (those alone), not '$tsan'" >&2; exit 2 ;;
esac
lanes=${TORCH_RPC_EXT_TEST_LANES:-3}
case "$lanes" in
  1 | 3) ;;
  *) echo "tools/test.sh: TORCH_RPC_EXT_TEST_LANES is 3 (the default: three lanes at once) or 1 (one after the other), not '$lanes'" >&2; exit 2 ;;
esac
# Two jobs that only build run in the background from here, at the lowest
# CPU priorities (they take the cores only when the tests leave them idle,
# as multi-process tests often do; nothing of theirs measures time): the
# newest torch's tree (a few GB of wheels to fetch, a build; nice 19) and,
# below it, the fuzzers' build (clang-14 + libFuzzer, ASan + UBSan; about
# 240 s of CPU on a quiet machine, a compile per core at a time;
# SCHED_IDLE where chrt is, else nice 19), needed later. Their logs are in
# build/ and shown if they fail; the stages that need them wait for them.
mkdir -p build
declare -A job_pid job_log
kill_tree() {
  local child
  for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
# read_cpu sets CPU_NOW to this shell's children's CPU seconds: bash's
# `times`, its second line, written to a file (in $(...) it would run in a
# subshell and count that subshell's children). Each lane is a shell of its
# own, so the background builds (children of the first shell) are not in
# its stages; each build reports its own CPU (background below).
read_cpu() {
  local f=build/.times.$BASHPID
  times >"$f"
  CPU_NOW=$(awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, t, "m"); n += t[1] * 60 + t[2] }
    printf "%d", n }' "$f")
  rm -f "$f"
}
# A job's exit status is written beside its log ($log.rc), so that the
# other lanes (subshells, which cannot `wait` for their siblings) can await
# a build too. `background NICE NAME LOG CMD...`.
background() {
  local niceness=$1 name=$2 log=$3
  shift 3
  rm -f "$log.rc"
  (
    # Not `"$@" || status=$?`: that would run a shell function with set -e
    # off, and a failing stage would go unnoticed.
    # (And the CPU it used, $log.cpu, before its status, which awaiters poll.)
    trap 'status=$?; read_cpu || CPU_NOW="?"; echo "$CPU_NOW" >"$log.cpu"; echo "$status" >"$log.rc"' EXIT
    exec >"$log" 2>&1
    if [ "$niceness" = idle ] && chrt --idle 0 true 2>/dev/null; then
      chrt --idle 0 "$@"
    elif [ "$niceness" = 0 ]; then
      "$@"
    else
      nice -n "${niceness/idle/19}" "$@"
    fi
  ) &
  job_pid[$name]=$!
  job_log[$name]=$log
}
# A build a lane waits for no longer yields to the tests: it and what it
# starts from then on run at their priority (session 109's clean run, three
# lanes: the second waited 268 s for the newest torch's setup, still at
# nice 19 beside the other two lanes' tests, and ended last by 180 s).
# Raising a priority needs root (CI's case); elsewhere the job keeps its own.
raise_tree() {
  local child
  renice -n 0 -p "$1" >/dev/null 2>&1 || true
  chrt --other -p 0 "$1" >/dev/null 2>&1 || true
  for child in $(pgrep -P "$1" || true); do raise_tree "$child"; done
}
await() {
  local name=$1 pid=${job_pid[$1]} log=${job_log[$1]} status
  if [ ! -s "$log.rc" ] && kill -0 "$pid" 2>/dev/null; then
    raise_tree "$pid"
  fi
  while [ ! -s "$log.rc" ] && kill -0 "$pid" 2>/dev/null; do sleep 1; done
  status=$(cat "$log.rc" 2>/dev/null || echo "killed")
  unset "job_pid[$name]"
  if [ "$status" != 0 ]; then
    cat "$log" >&2
    echo "tools/test.sh: $name failed ($status; above, log $log)" >&2
    exit 1
  fi
  echo "== tools/test.sh: $name used $(cat "$log.cpu") s of CPU" >&2
}
# (Only what is still running: a job that ended left its status.)
trap 'for n in "${!job_pid[@]}"; do [ -s "${job_log[$n]}.rc" ] || kill_tree "${job_pid[$n]}"; done' EXIT
# The newest torch's setup starts first, before this tree's own (its
# download, a few GB, waits on the network while this .venv installs and
# builds); not in another torch's tree (.synced-files) or for a pytest run.
if [ "$#" -eq 0 ] && [ ! -f .synced-files ] && [ "${TORCH_RPC_EXT_SKIP_NEWEST:-0}" != 1 ] && [ "$tsan" != only ]; then
  # The newest torch's tree takes about 8 GB of disk while it installs (a
  # CUDA build and its NVIDIA wheels, downloaded, then unpacked into its
  # .venv; 5.5 GB stays). Too little free fails it with "No space left on
  # device" after the first stages (CI's did, 18 minutes in, when old clones
  # filled the disk); say so now instead. pip keeps no copy of those wheels.
  newest_need_gb=9
  # (Both trees install at once on a fresh clone: the first .venv's ~3 GB too.)
  compgen -G ".venv/.packages-test-*" >/dev/null || newest_need_gb=12
  if ! compgen -G "build/torch-$NEWEST_TORCH/.venv/.packages-test-*" >/dev/null; then
    free_kb=$(df -Pk build | awk 'NR == 2 { print $4 }')
    if [ "$free_kb" -lt $((newest_need_gb * 1024 * 1024)) ]; then
      echo "tools/test.sh: torch $NEWEST_TORCH's stages need about $newest_need_gb GB free under $PWD/build; $((free_kb / 1024 / 1024)) GB is free. Free some, or leave those stages out with TORCH_RPC_EXT_SKIP_NEWEST=1." >&2
      exit 1
    fi
  fi
  newest_started=1
  PIP_NO_CACHE_DIR=1 background 19 newest-torch-setup build/newest-torch-setup.log \
    bash tools/with_torch.sh "$NEWEST_TORCH" bash -c 'SETUP_FOR=test . tools/setup_env.sh'
fi
SETUP_FOR=test . tools/setup_env.sh
read_cpu
setup_cpu=$CPU_NOW
# Upstream's per-test limit for multi-process tests (default 300 s); every
# test here takes seconds, so a hang is cut short sooner.
export DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=${DISTRIBUTED_TESTS_DEFAULT_TIMEOUT:-180}
if [ "$#" -gt 0 ]; then
  exec python -m pytest -p no:cacheprovider -q --timeout 900 "$@"
fi
torch_version=$(python -c 'import torch; print(torch.__version__)')
# Each stage's log line names its torch; when it ends, its time, and at the
# end of the run a table of them (CI's budget is 45 minutes on 2 cores).
# And the CPU it used (user + system, of the processes it started and
# waited for): a clean run on 2 cores is bound by CPU, not by waits
# (docs/development.md, "Where a clean run's time goes").
stage_name=""
stage_start=0
stage_cpu=0
stage_times=()
stage_end() {
  [ -n "$stage_name" ] || return 0
  local took=$((SECONDS - stage_start))
  read_cpu
  local cpu=$((CPU_NOW - stage_cpu))
  echo "== tools/test.sh: $stage_name: $took s, $cpu s of CPU" >&2
  stage_times+=("$(printf '%5d s %6d s CPU  %s' "$took" "$cpu" "$stage_name")")
  stage_name=""
}
stage() {
  stage_end
  stage_name="$1 on torch $torch_version"
  stage_start=$SECONDS
  read_cpu
  stage_cpu=$CPU_NOW
  echo "== tools/test.sh: $stage_name" >&2
}
stage_table() {
  stage_end
  echo "== tools/test.sh: stages on torch $torch_version, $SECONDS s in all" >&2
  printf '%s\n' "${stage_times[@]}" >&2
}
# Each stage's pytest lists its 15 slowest tests (of 1 s or more), so a run
# that grows past CI's budget says where the time went.
pytest() {
  python -m pytest -p no:cacheprovider -q --durations 15 --durations-min 1 "$@"
}
# And the 15 tests and files that used the most CPU (tests/cpu_use.py): a
# clean run on 2 cores is bound by CPU, not by waits. Exported: the
# sanitizer's and the newest torch's runs list theirs too.
export TORCH_RPC_EXT_CPU_TOP=${TORCH_RPC_EXT_CPU_TOP:-15}

if [ "$TORCH_VERSION" != "$DEFAULT_TORCH" ]; then
  # Another torch (tools/with_torch.sh): upstream's suites, our tests that
  # start processes, and the wheel; the unit tests, the fake-CUDA ones, the
  # tutorials and the fuzzers are the default torch's (the fake CUDA device
  # needs a CPU torch).
  # Upstream's suites run here over TCP only, the first torch's over shm:
  # each transport and each torch meet the whole suite once within CI's 45
  # minutes (both transports are the same C++ on every torch; what differs
  # by torch is the Python and C++ that meets torch, which either pass
  # drives). Our multi-process tests here run over shm. `bash
  # tools/with_torch.sh VERSION bash tools/test.sh tests/conformance` runs
  # the suites over shm on VERSION.
  # Of tests/rpc, the tests of our own transports, channels, wire and
  # crypto against hostile or failing peers (most of them raw sockets or
  # _testing.Endpoint against the stream core: the handshake's bounds and
  # stalls, a guessing source held off, frame rings, peer descriptors,
  # lanes on a hostile wire, a peer's last words; and lanes, the loop's
  # registrations, TLS and its guessers, whose calls through torch's API
  # only carry what they test: ~23 s of CPU and 60 s here, session 109) and
  # at scale are left to the first torch, for the same reason (a peer's
  # failure stays: what torch's RRef forks and shutdown do when a peer
  # dies is torch's); of the launcher's unmodified example programs, one (rnn_ps.py: DistributedOptimizer, TensorPipe's options)
  # runs here. `bash tools/with_torch.sh VERSION bash tools/test.sh
  # tests/rpc tests/launcher` runs them all.
  # Over TLS ("always": loopback too), what every connection between hosts
  # is by default: TLS differs from plain TCP only in how the stream core
  # reads and writes, which plain TCP's own tests (tests/rpc/test_scale.py,
  # test_rendezvous.py, tests/crosshost's "clear" runs) drive.
  stage "conformance over TCP with TLS"
  TORCH_RPC_EXT_TRANSPORTS=tcp TORCH_RPC_EXT_ENCRYPTION=always \
    pytest --timeout 900 tests/conformance
  stage "our multi-process tests, scripting, launcher, wheel"
  example=tests/launcher/test_launcher.py::test_program_gives_tensorpipes_results_under_the_launcher
  pytest --timeout 900 tests/rpc tests/scripting tests/launcher tests/wheel \
    --ignore tests/rpc/test_scale.py --ignore tests/rpc/test_soak.py \
    --ignore tests/rpc/test_fuzz.py --ignore tests/rpc/test_benchmark_smoke.py \
    --ignore tests/rpc/test_tls_wire.py --ignore tests/rpc/test_hostile_peers.py \
    --ignore tests/rpc/test_shm_slabs.py --ignore tests/rpc/test_shm_transport.py \
    --ignore tests/rpc/test_libcrypto.py --ignore tests/rpc/test_preauth_bounds.py \
    --ignore tests/rpc/test_frame_ring.py --ignore tests/rpc/test_peer_descriptors.py \
    --ignore tests/rpc/test_lanes_wire.py --ignore tests/rpc/test_last_words.py \
    --ignore tests/rpc/test_handshake_stalls.py --ignore tests/rpc/test_source_holdoff.py \
    --ignore tests/rpc/test_lanes.py --ignore tests/rpc/test_loop_registration.py \
    --ignore tests/rpc/test_tls.py --ignore tests/rpc/test_tls_guessing.py \
    --deselect "$example[batch_ps.py-weights-3]" --deselect "$example[pipeline.py-losses-3]" \
    --deselect "$example[rl_observers.py-losses-3]"
  stage_table
  exit 0
fi

# ThreadSanitizer's stages (TORCH_RPC_EXT_TSAN=1 or only), once its tree is
# built. Not in the default run, for CI's 45 minutes on 2 cores: the tree
# and the tests took ~400 s of CPU on a quick machine (session 109), twice
# that on a slow one, at the end of the first lane; and of the reports that
# failed CI runs (stops 104, 107, 108) every one was inside torch.
tsan_stages() {
  # ThreadSanitizer over the parts whose threads meet most (docs/development.md,
  # "The suites under a sanitizer"): a dynamic group's watcher, leases, secret
  # exchange (with a passphrase too) and membership log against its init
  # thread and the listener, the loop, the thread pool, the buffer pool, the
  # descriptor closer (in process); then, between processes, public calls, the small-call fast path,
  # shm slabs, a shm connection's frame ring, socket and last words, a peer's
  # failure, elastic groups. Any report fails the run. (The whole of the
  # suites under TSan takes hours here; these about four minutes once built.)
  # The forking files run in a pytest of their own: a child forked while its
  # parent has threads running is outside what TSan supports (a new thread of
  # the child can reuse a live one's id: "dup thread with used id"), so no
  # in-process test's threads may be alive when they fork.
  stage "ThreadSanitizer: the agent's parts, calls between processes"
  bash tools/sanitize.sh thread tests/unit/test_agent_parts.py \
    tests/unit/test_group_passphrase.py \
    tests/unit/test_membership_log.py tests/unit/test_loop.py \
    tests/unit/test_thread_pool.py tests/unit/test_buffer_pool.py \
    tests/unit/test_fd_closer.py
  bash tools/sanitize.sh thread tests/rpc/test_public_calls.py \
    tests/rpc/test_fast_path.py tests/rpc/test_shm_slabs.py \
    tests/rpc/test_shm_transport.py tests/rpc/test_frame_ring.py \
    tests/rpc/test_last_words.py tests/rpc/test_peer_failure.py \
    tests/rpc/test_elastic.py
  # And the CUDA path (the fake driver built with TSan too, so that it judges
  # our streams and events by the order the fake models): the soak's crossing
  # calls of random CUDA tensors through every channel and landing. In this
  # lane, after the others: two runs over one tree must not overlap (each
  # begins with the tree's build, which replaces the module the other's
  # workers load).
  stage "ThreadSanitizer: the CUDA path on the fake driver (the soak)"
  bash tools/sanitize.sh thread tests/cuda_driver/test_agent_soak.py
}
# The ThreadSanitizer tree (tools/sanitize.sh: a copy of this checkout
# with a .venv that borrows this one's packages and a TSan build, ~2 min of
# 2 cores from nothing, a few seconds when only tests changed), when asked:
# built the same way, for the first lane's last stages; or alone, then
# those stages and nothing else.
if [ "$tsan" = only ]; then
  stage "ThreadSanitizer: its tree's build"
  SANITIZE_BUILD_ONLY=1 bash tools/sanitize.sh thread
  tsan_stages
  stage_table
  exit 0
elif [ "$tsan" = 1 ]; then
  background idle tsan-build build/tsan-build.log \
    env SANITIZE_BUILD_ONLY=1 bash tools/sanitize.sh thread
fi

# The fuzzers' build needs this .venv's torch (its headers, for fuzz_codec).
background idle fuzz-build build/fuzz-build.log bash tests/fuzz/build.sh
# The stages run in three lanes at once: our multi-process suites wait more
# than they compute (with one lane, 2 cores were idle about half the time:
# stage 1 alone took 1207 s and the fake stage 629 s; side by side, 1439 s
# and 988 s, every test green; docs/development.md). The first lane runs
# here: upstream's suites over shm with our multi-process tests. The second
# (second_lane below, its output in build/lane-2.log, shown when it ends):
# the tutorials, the newest torch's stages, then the fuzzers' round. The
# third (third_lane, build/lane-3.log): the unit tests with the fake CUDA
# driver's, then upstream's fault-injection suites, which wait most of all
# (session 109's clean run: 627 s for 113 s of CPU, and 97 s for 18), so
# they no longer hold the second lane back (it ended 4 minutes after the
# first there), then the launcher's tests and those between network
# namespaces, from the first.
# TORCH_RPC_EXT_TEST_LANES=1 runs the lanes one after the other instead
# (a flake that load may cause can be told apart that way).
second_lane() {
  # The tutorials (each notebook in a Jupyter kernel of its own, whose
  # workers are processes of their own): on a clean clone they fill what
  # this lane would otherwise spend waiting for the newest torch's download
  # and build.
  stage "tutorials"
  pytest --timeout 900 tests/tutorials
  # The newest torch's stages before the fuzzers' round: its setup (a
  # download, then a build at nice 19) is what this lane would wait for
  # longest, and the fuzzers' build (SCHED_IDLE, below the setup) is done
  # by the time the round comes.
  if [ "${newest_started:-0}" = 1 ]; then
    stage "setting up torch $NEWEST_TORCH (what is left of it)"
    await newest-torch-setup
    grep -E "^(setup_env|with_torch)" build/newest-torch-setup.log >&2 || true
    stage "torch $NEWEST_TORCH's stages (its own tree, .venv and build)"
    # tests/wheel there installs its wheel beside this .venv's torch too.
    TORCH_RPC_EXT_OTHER_TORCH_SITE=$(python -c "import sysconfig; print(sysconfig.get_path('purelib'))") \
      bash tools/with_torch.sh "$NEWEST_TORCH" bash tools/test.sh
  fi
  # The in-process fuzzers (tests/fuzz; docs/reliability.md, "In-process
  # fuzzing"): a bounded round of about a minute over the parsers a peer
  # reaches, from the seed corpus, once their build is done (run.sh
  # rebuilds nothing then). Any finding fails the run.
  stage "fuzzers (the rest of their build, then the round)"
  await fuzz-build
  grep -E "^(built|fuzz build)" build/fuzz-build.log >&2 || true
  bash tests/fuzz/run.sh
}
# Multi-process tests fork from the pytest process; it must not have run
# torch compute first (a forked child inherits ATen's started thread pools and
# aborts or hangs on first use), so unit tests get a process of their own.
third_lane() {
  # With them, the fake CUDA driver's own tests (they load it in this
  # process) and the driver layer's against it (in spawned processes).
  stage "unit tests, the fake CUDA driver, the driver layer"
  pytest --timeout 300 tests/unit tests/cuda_fake tests/cuda_driver
  # Upstream's fault-injection suites: a process of their own (see the module).
  stage "upstream's fault-injection suites"
  pytest --timeout 900 tests/faulty
  # Two folders of the first lane's (its multi-process tests), which would
  # otherwise be the longest lane by about 200 s: the launcher's (upstream-
  # style programs under TensorPipe and under the launcher) and those
  # between network namespaces.
  stage "the launcher, and between network namespaces"
  pytest --timeout 900 tests/launcher tests/crosshost
}
if [ "$lanes" = 3 ]; then
  lane_alone() {
    "$1"
    stage_table
  }
  background 0 lane-2 build/lane-2.log lane_alone second_lane
  background 0 lane-3 build/lane-3.log lane_alone third_lane
fi

# Same-host peers use the shm transport by default.
# The first lane is a subshell too, so that the CPU its stages count is
# theirs alone (the background builds are this shell's children).
first_lane() {
  stage "conformance over shm, multi-process tests, wheel, CUDA kernels"
  pytest --timeout 900 tests/conformance tests/rpc tests/scripting \
    tests/wheel tests/cuda_kernels tests/conformance_cuda
  # (The pass over TCP only is the newest torch's, below: the transports are
  # the same C++ on every torch, and CI's 45 minutes hold one such pass.)
  # ThreadSanitizer's stages, when asked (tsan_stages above).
  if [ "$tsan" = 1 ]; then
    stage "ThreadSanitizer: the rest of its tree's build"
    await tsan-build
    tsan_stages
  fi
  if [ "$lanes" = 3 ]; then
    stage "waiting for the other lanes"
    # Whichever ends first is awaited first: a lane that fails ends the run
    # then, not when the other ends.
    local pending=(2 3) n
    while [ "${#pending[@]}" -gt 0 ]; do
      for n in "${pending[@]}"; do
        if [ -s "build/lane-$n.log.rc" ] || ! kill -0 "${job_pid[lane-$n]}" 2>/dev/null; then
          await "lane-$n"
          echo "== tools/test.sh: lane $n (build/lane-$n.log):" >&2
          cat "build/lane-$n.log" >&2
          pending=("${pending[@]/$n/}")
          read -ra pending <<<"${pending[*]}"
        fi
      done
      sleep 1
    done
  else
    stage_end
    third_lane
    second_lane
  fi
  stage_table
}
( first_lane )
# What the whole run cost: every process it started has ended by now (the
# lanes, the builds, what they started); `wait` reaps any not yet reaped.
wait || true
read_cpu
echo "== tools/test.sh: $SECONDS s, $CPU_NOW s of CPU in all ($setup_cpu s of it before the lanes began: .venv, its build, any background build done by then; $((CPU_NOW * 100 / (SECONDS > 0 ? SECONDS : 1))) % of one core on average)" >&2
