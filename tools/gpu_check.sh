#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The project's GPU check, sized for one device call of at most 9 minutes
# from a bare machine (docs/cuda.md, "Checking on a GPU"). From the project
# root of a machine with an NVIDIA GPU and a CUDA torch:
#   OUT=DIR bash tools/gpu_check.sh [--fake] [PYTEST_ARGS...]
# Stages (the build, then the steps of STEPS), each step cut at its own
# limit, all of them inside BUDGET seconds (540) from the start:
#   1. wheels: .whl/ (numpy<2.5, expecttest; ../shared/tools/gpu_wheels.sh
#      fetches them) into /tmp/site, ahead of the system's;
#   2. build: in place, on every core (120 s; 61 s on a 16-core H200);
#   3. side by side, none of them timing anything (300 s together):
#      ptx            the kernels' PTX made there by numba-cuda (to show it
#                     works there; what loads is the PTX the package ships);
#      pytest         tests/cuda_driver and tests/cuda_kernels (the real
#                     driver) and PYTEST_ARGS;
#      upstream_cuda  upstream's CUDA suites (tests/conformance_cuda, four
#                     spawned processes a test; those needing more GPUs
#                     than there are skip unspawned), on pytest-xdist if there;
#   4. alone on the GPU, as they time things: probe (tools/gpu_probe.py,
#      short, and its IPC check matters more than the bench), then bench
#      (benchmarks/cuda_bench.py, ours beside TensorPipe) in what is left;
#   5. optional, in what the budget has left (skipped, not failed, without
#      it): costs (tools/gpu_costs.py --hops-only: a hop between two
#      processes that share the GPU, in eleven modes, <= 60 s), then
#      peer_death (tools/gpu_peer_death.py: whether a stream waiting on a
#      killed process's IPC event ever completes, docs/reliability.md,
#      "Peer death on the CUDA channels"; <= 45 s), then mps_bench (the
#      bench's main cases, ours and TensorPipe, under an MPS daemon the
#      step starts and stops: the workers' GPU work in one context, not
#      time-sliced between two; <= 100 s; skipped without MPS),
#      then mps_breakdown under the same daemon (benchmarks/
#      cuda_call_breakdown.py: a 4 KB call's segments, callee_run in its two
#      parts; <= 45 s).
# Files under $OUT, written as the steps go (7: the device tool returns 8):
#   summary.txt       the machine, one line per step (rc, seconds, tests
#                     passed/failed, the failing tests, the tests running
#                     when a step was cut or crashed), the bench's ratios
#   build.log         wheels, the build (its last lines if it passed), ptx
#   pytest.log        upstream.log    pytest -v -rfE, one each
#   bench.log         probe, bench, costs, mps_bench, mps_breakdown (rows)
#   cuda_bench.jsonl  cuda_bench.png  the bench's rows and chart
# A test step about to be cut appends to its log every thread's Python
# stack in each of its processes (spawned workers too), taken 8 s before
# the cut (faulthandler on SIGUSR1, armed by a sitecustomize on the steps'
# PYTHONPATH): where a hang was.
# A step is cut with SIGINT, so that pytest prints its summary (-rfE: every
# failure so far) and the test it was in; SIGKILL 10 s later if need be.
# STEPS="pytest bench" reruns only those (the build always runs; it is
# incremental). TESTS and UPSTREAM_TESTS replace what pytest and
# upstream_cuda run (pytest's arguments: files, node ids, -k), so that a
# second call can finish what a first one did not reach. On a GPU, TESTS
# leaves out tests/cuda_kernels/test_sim_*: numba's simulator, which CI runs
# and no GPU changes. --fake (or FAKE=1) runs the same on a machine without a GPU:
# no wheels, no build (SKIP_BUILD=1: the .so must be there), .venv's Python,
# the fake driver for pytest (tests/cuda_driver picks it) and bench
# (--fake); upstream_cuda skips itself, probe is skipped.
# Exit status: the number of failed steps (0 = all passed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
FAKE=${FAKE:-0}
if [ "${1:-}" = "--fake" ]; then FAKE=1; shift; fi
OUT=${OUT:-/tmp/gpu_check}
STEPS=${STEPS:-ptx pytest upstream_cuda probe bench costs peer_death mps_bench mps_breakdown}
if [ -z "${TESTS:-}" ]; then
  TESTS="tests/cuda_driver tests/cuda_kernels"
  [ "$FAKE" != 1 ] && TESTS+=" --ignore-glob=tests/cuda_kernels/test_sim_*"
fi
UPSTREAM_TESTS=${UPSTREAM_TESTS:-tests/conformance_cuda}
BUDGET=${BUDGET:-540}
CAP_BUILD=${CAP_BUILD:-120} CAP_TESTS=${CAP_TESTS:-300}
CAP_PROBE=${CAP_PROBE:-60} CAP_BENCH=${CAP_BENCH:-300}
# Fewer calls than the bench's defaults (50, 10, 5, 5), as in the 2026-11-26
# H200 run, so that it fits what stage 4 has.
BENCH_ARGS=${BENCH_ARGS:---calls 20 --calls-large 5 --warmup 3 --recipe-rounds 3}
if [ "$FAKE" = 1 ]; then
  SKIP_BUILD=${SKIP_BUILD:-1}
  [ -x .venv/bin/python ] && PYTHON=${PYTHON:-.venv/bin/python}
fi
SKIP_BUILD=${SKIP_BUILD:-0}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
rm -f "$SUMMARY" "$OUT"/{build,pytest,upstream,bench}.log "$OUT"/cuda_bench.{jsonl,png}
export PYTHONUNBUFFERED=1 TORCH_RPC_EXT_BUILD_TESTING=1
export TORCH_RPC_EXT_CACHE_DIR=/tmp/torch_rpc_ext_cache

wanted() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

# limit WANT RESERVE: WANT seconds, or fewer, so that RESERVE seconds for the
# stages after this one and 10 s for a kill stay inside BUDGET.
limit() {
  local most=$((BUDGET - SECONDS - $2 - 10))
  echo $(($1 < most ? $1 : most))
}

# pytest_facts LOG RC: the tally, the failing tests and, for a run cut or
# killed by a signal (a crash too), the tests running then, from pytest's -v
# progress lines and -rfE summary (its last line is missing when pytest did
# not end itself: the progress lines are counted).
pytest_facts() {
  awk -v cut="$([ "$2" = 124 ] || [ "$2" -gt 128 ] 2>/dev/null && echo 1)" '
    function short(id) { sub(/^[^:]*\//, "", id); return id }
    /^=+ .* in [0-9.]+s/ { tally = $0; gsub(/^=+ | =+$/, "", tally) }
    /^== [0-9]+ s: / { next }
    # A stack dump names each process by its command line (--deselect ids).
    /^-- pid [0-9]+: / { next }
    {
      id = ""
      for (i = 1; i <= NF; i++) if ($i ~ /\.py::/) { id = $i; break }
      progress = $0 ~ /\[ *[0-9]+%\]/
      # Without xdist, output of a test'"'"'s own processes can split its line:
      # an outcome with no test id is the last started test'"'"'s.
      if (id == "" && progress && last != "") id = last
      if (id == "") next
      if (match($0, /(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)/)) {
        word = substr($0, RSTART, RLENGTH)
        done[id] = 1
        if (progress) n[word]++
        if ((word == "FAILED" || word == "ERROR") && !(id in bad)) {
          bad[id] = 1
          badlist = badlist " " short(id)
        }
      } else { started[id] = 1; last = id }
    }
    END {
      if (tally == "") {
        for (w in n) tally = tally (tally == "" ? "so far: " : ", ") n[w] " " tolower(w)
        if (tally == "") tally = "no test ended"
      }
      printf "%s", tally
      if (badlist != "") printf "; failed:%s", badlist
      if (cut) {
        run = ""
        for (id in started) if (!(id in done)) run = run " " short(id)
        printf "; running then:%s", (run == "" ? " (none seen)" : run)
      }
    }' "$1"
}

# note NAME RC SECONDS [FACTS]: the step's line in summary.txt, and on stdout.
note() {
  local rc=$2 facts=${4:-}
  case $rc in
    124 | 137) facts="cut at its limit${facts:+; $facts}" ;;
    1[3-9][0-9]) facts="killed by signal $((rc - 128))${facts:+; $facts}" ;;
  esac
  printf '%-13s rc=%-4s %4d s  %s\n' "$1" "$rc" "$3" "$facts" | tee -a "$SUMMARY"
}

# Python stacks on demand: a sitecustomize (on the test steps' PYTHONPATH)
# makes every Python process of theirs dump all its threads' stacks into
# STACKS/PID.txt on SIGUSR1. dump_stacks ROOT NAME LOG signals ROOT's
# Python descendants and appends what they wrote, each under its command
# line, to LOG.
STACKS=/tmp/gpu_check_stacks
rm -rf "$STACKS"
mkdir -p "$STACKS/site"
cat >"$STACKS/site/sitecustomize.py" <<'EOF'
import faulthandler, os, signal
_dir = os.environ.get("GPU_CHECK_STACKS")
if _dir:
    _file = open(os.path.join(_dir, f"{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True)
EOF

descendants() {
  ps -e -o pid=,ppid= | awk -v root="$1" '
    { parent[$1] = $2 }
    END {
      for (p in parent) {
        for (q = p; q in parent && q != root && q > 1; q = parent[q]) {}
        if (q == root && p != root) print p
      }
    }'
}

dump_stacks() {
  local root=$1 name=$2 log=$3 pids p
  pids=$(descendants "$root")
  for p in $pids; do
    [ -f "$STACKS/$p.txt" ] && kill -USR1 "$p" 2>/dev/null
  done
  sleep 2
  {
    echo "== ${SECONDS} s: $name is about to be cut; Python stacks of its processes"
    for p in $pids; do
      [ -s "$STACKS/$p.txt" ] || continue
      echo "-- pid $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-300)"
      cat "$STACKS/$p.txt"
    done
  } >>"$log"
}

# step NAME LOG SECONDS COMMAND...: run it, appending to LOG, cut after
# SECONDS (SIGINT, then SIGKILL); note it. Returns its status.
# ratios FILE PREFIX: the bench's ratio lines into the summary, one line
# per kind: "PREFIXtime_ext_over_tp: identity_4KB 0.675 ...".
ratios() {
  sed -n 's/.*"case": "\([^"]*\)", "ratio": "\([^"]*\)", "value": \([0-9.]*\).*/\2 \1 \3/p' \
    "$1" 2>/dev/null |
    awk -v prefix="$2" '{ line[$1] = line[$1] " " $2 " " $3 }
      END { for (k in line) print prefix k ":" line[k] }' |
    tee -a "$SUMMARY"
}

step() {
  local name=$1 log=$2 secs=$3 start pid rc facts=""
  shift 3
  if [ "$secs" -lt 5 ]; then
    note "$name" - 0 "not run: the budget was spent"
    return 1
  fi
  start=$SECONDS
  echo "== ${start} s: $name, cut at ${secs} s: $*" | tee -a "$log"
  # timeout leads a process group of its own (and resets SIGINT, which a
  # background job ignores, for the command): what the step left running,
  # such as a test's spawned workers, is killed with the group, so that it
  # holds neither the GPU nor the cores while the next steps run.
  timeout --signal=INT --kill-after=10 "$secs" "$@" >>"$log" 2>&1 &
  pid=$!
  local watcher=""
  case $name in
    pytest | upstream_cuda)
      (sleep $((secs > 20 ? secs - 8 : secs)) && dump_stacks "$pid" "$name" "$log") &
      watcher=$!
      ;;
  esac
  wait "$pid"
  rc=$?
  [ -n "$watcher" ] && kill "$watcher" 2>/dev/null
  kill -KILL -- "-$pid" 2>/dev/null
  case $name in
    pytest | upstream_cuda) facts=$(pytest_facts "$log" "$rc") ;;
    probe) facts=$(grep -o '"failures": [0-9]*' "$log" | tail -n 1) ;;
    bench) facts="$(grep -c median_us "$OUT/cuda_bench.jsonl" 2>/dev/null || echo 0) rows" ;;
  esac
  note "$name" "$rc" $((SECONDS - start)) "$facts"
  return "$rc"
}

{
  echo "gpu_check $(date -u +%FT%TZ) fake=$FAKE STEPS=\"$STEPS\" budget ${BUDGET} s"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '(no .git)')"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 |
      sed 's/^/gpu: /'
  else
    echo "gpu: none (no nvidia-smi)"
  fi
  echo "cores: $(nproc); python: $PY"
} >>"$SUMMARY"
failed=0

# 1. Wheels: the GPU machine has no network. Not under --fake: they are for
# the GPU machine's Python, and .venv has its own.
if [ "$FAKE" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  step wheels "$OUT/build.log" 60 "$PY" -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --target /tmp/site --upgrade .whl/*.whl ||
    failed=$((failed + 1))
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
"$PY" - >>"$SUMMARY" 2>&1 <<'EOF'
from importlib import metadata
have = []
for name in ("torch", "numpy", "numba", "numba-cuda", "pytest-xdist", "expecttest"):
    try:
        have.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        have.append(f"{name} -")
print("packages:", ", ".join(have))
EOF

# 2. Build. Everything after it needs the extension: a failed build ends the
# run (build.log is kept whole then).
if [ "$SKIP_BUILD" = 1 ]; then
  if ls torch_rpc_ext/_C*.so >/dev/null 2>&1; then
    note build skip 0 "SKIP_BUILD=1: the extension built earlier"
  else
    note build - 0 "SKIP_BUILD=1 and no torch_rpc_ext/_C*.so: build it first"
    exit 1
  fi
else
  before=0
  [ -f "$OUT/build.log" ] && before=$(wc -l <"$OUT/build.log")
  if ! step build "$OUT/build.log" "$(limit "$CAP_BUILD" 0)" \
    env MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" setup.py build_ext --inplace; then
    tail -n 40 "$OUT/build.log"
    exit $((failed + 1))
  fi
  # The toolchain, and whether it linked pieces of libstdc++'s iostreams or
  # locale into the extension (the first 2026-11-26 H200 runs: /opt/gcc's
  # g++ did, and number parsing through a second copy of the locale's
  # facets crashed; csrc keeps numbers out of iostreams since).
  {
    echo "compiler: $(${CXX:-c++} --version 2>&1 | head -n 1)"
    echo "libstdc++ stream/locale symbols defined in _C: $(nm -DC --defined-only \
      torch_rpc_ext/_C*.so 2>/dev/null | grep -cE 'std::(locale|istream|ostream|basic_i|basic_o|num_get|num_put|codecvt)')"
    # setup.py's word on the toolchain (torch_rpc_ext/_toolchain.py), if any.
    grep -a '^torch_rpc_ext: ' "$OUT/build.log" | sort -u
    # How the landing pool routes here: "torch" where the build had the
    # runtime's crt/ headers (.whl: nvidia-cuda-crt; docs/cuda.md).
    echo "landing pool routing: $("$PY" -c 'import torch; from torch_rpc_ext import _C; print(repr(_C._pool_routing()))' 2>&1 | tail -n 1)"
  } >>"$SUMMARY"
  # Passed: the wheels' lines and the build's last 20 are enough.
  { head -n "$before" "$OUT/build.log"
    echo "... (the build's last 20 lines)"
    tail -n 20 "$OUT/build.log"; } >"$OUT/build.tail" && mv "$OUT/build.tail" "$OUT/build.log"
fi

# 3. Correctness, side by side: nothing here is timed, so sharing the cores
# and the GPU costs only wall time. Each step writes a log of its own (ptx
# appends to build.log, which nothing else writes now). 110 s stay for probe
# and bench (13 s and 42 s on the 2026-11-26 H200 runs).
secs=$(limit "$CAP_TESTS" 110)
pids=()
stacks_env=(GPU_CHECK_STACKS="$STACKS" PYTHONPATH="$STACKS/site:$PYTHONPATH")
# pytest-xdist where the machine has it (the 2026-11-26 H200 had): our tests
# run one after the other otherwise, some 50 of them spawning two workers
# each, which on their own may outlast the stage.
have_xdist=0
"$PY" -c 'import xdist' 2>/dev/null && have_xdist=1
if wanted ptx; then
  step ptx "$OUT/build.log" "$secs" "$PY" -m torch_rpc_ext._cuda.ptx --out /tmp/gpu_ptx &
  pids+=($!)
fi
if wanted pytest; then
  # -v: progress lines name each test as it starts; --timeout: a hung test
  # fails with its stack, and the next one runs (tests marked otherwise,
  # such as test_cuda_bench.py's 600 s, keep theirs); --durations: where the
  # step's time went (217 s alone on the fake, 2 cores).
  ours=()
  [ "$have_xdist" = 1 ] && [ "$FAKE" != 1 ] && ours=(-n 6)
  # The bench's own test (--smoke, both backends) is what the bench step
  # runs in full, alone on the GPU: not here too, beside the others.
  [ "$FAKE" != 1 ] && ours+=(--deselect
    tests/cuda_driver/test_cuda_bench.py::test_cuda_bench_runs_every_case)
  read -ra tests <<<"$TESTS"
  step pytest "$OUT/pytest.log" "$secs" env "${stacks_env[@]}" \
    "$PY" -m pytest -p no:cacheprovider -v -rfE \
    --durations=20 --timeout 90 "${ours[@]}" "${tests[@]}" "$@" &
  pids+=($!)
fi
if wanted upstream_cuda; then
  # Each test's own limit is upstream's DISTRIBUTED_TESTS_DEFAULT_TIMEOUT (the
  # module's timeout mark of 600 s overrides --timeout). Half the cores less
  # the 4 of our own tests as xdist workers, at most 6: each test spawns
  # four processes.
  xdist=()
  if [ "$have_xdist" = 1 ]; then
    n=$(($(nproc) / 2 - 2))
    xdist=(-n $((n < 1 ? 1 : n > 6 ? 6 : n)))
  fi
  read -ra upstream <<<"$UPSTREAM_TESTS"
  step upstream_cuda "$OUT/upstream.log" "$secs" env "${stacks_env[@]}" \
    DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=60 \
    "$PY" -m pytest -p no:cacheprovider -v -rfE --durations=20 "${xdist[@]}" \
    "${upstream[@]}" &
  pids+=($!)
fi
for pid in "${pids[@]}"; do
  wait "$pid" || failed=$((failed + 1))
done

# 4. Timed, alone on the GPU: the probe first (short; its IPC check is a
# correctness check too), then the bench in what is left of the budget.
if wanted probe; then
  if [ "$FAKE" = 1 ]; then
    note probe skip 0 "no GPU (--fake): the probe has no fake"
  else
    step probe "$OUT/bench.log" "$(limit "$CAP_PROBE" 90)" \
      "$PY" tools/gpu_probe.py --ptx torch_rpc_ext/_cuda/shipped_ptx ||
      failed=$((failed + 1))
  fi
fi
if wanted bench; then
  read -ra bench <<<"$BENCH_ARGS"
  libcuda=()
  if [ "$FAKE" = 1 ]; then
    # The fake driver, as tests/cuda_driver builds it (once; kept in build/).
    libcuda=("TORCH_RPC_EXT_LIBCUDA=$("$PY" -c \
      'from tests import cuda_fake; print(cuda_fake.build())' 2>>"$OUT/bench.log")")
    bench=(--fake)
  fi
  step bench "$OUT/bench.log" "$(limit "$CAP_BENCH" 0)" env "${libcuda[@]}" \
    "$PY" benchmarks/cuda_bench.py "${bench[@]}" \
    --out "$OUT/cuda_bench.jsonl" --chart "$OUT/cuda_bench.png" || failed=$((failed + 1))
  ratios "$OUT/cuda_bench.jsonl" ""
  # "recipe phases (us): ext forward 1200.5 backward 1500.2 local_only 300.1; ..."
  "$PY" -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if "phases_us" in l]
parts = ["%s %s" % (r.get("backend"), " ".join("%s %s" % kv for kv in r["phases_us"].items()))
         for r in rows]
if parts:
    print("recipe phases (us): " + "; ".join(parts))' "$OUT/cuda_bench.jsonl" 2>/dev/null |
    tee -a "$SUMMARY"
fi

# 5. What the bench's small-call figures rest on (issue 46): the price of
# each CUDA primitive and of a hop between two processes sharing the GPU
# (tools/gpu_costs.py, no build needed; 17-32 s on the H200), then the
# bench's main cases (and the recipe) again under MPS, where the two
# workers' work shares one GPU context instead of time-slicing two (the
# 2026-11-27 H200: a hop in which both processes touch the GPU cost ~320 us
# against a 40 us pipe round trip). Both optional: skipped, not failed,
# where the budget has no time left for them.
# optional NAME WANT LEAST: for an optional step, sets `secs` to WANT
# seconds or what the budget has left; with no GPU (--fake), or under LEAST
# seconds left, notes that the step was skipped (not failed) and fails.
optional() {
  if [ "$FAKE" = 1 ]; then
    note "$1" skip 0 "no GPU (--fake)"
    return 1
  fi
  secs=$(limit "$2" 0)
  if [ "$secs" -lt "$3" ]; then
    note "$1" skip 0 "no time left in the budget (optional; STEPS=$1 runs it alone)"
    return 1
  fi
}
# (--hops-only: the primitives' host prices were measured in three runs,
# 2026-11-27 to 28, and do not move; the hops have modes new since, session
# 58.)
if wanted costs && optional costs 60 5; then
  step costs "$OUT/bench.log" "$secs" "$PY" tools/gpu_costs.py --n 1500 --hops-only ||
    failed=$((failed + 1))
  # "hops (us): blocking 39.5 spinning 32.8 no_dependency 318.7 ..."
  sed -n 's/.*"op": "hop \([a-z_]*\):[^"]*", "us": \([0-9.]*\).*/\1 \2/p' "$OUT/bench.log" |
    awk '{ s = s " " $1 " " $2 } END { if (s != "") print "hops (us):" s }' |
    tee -a "$SUMMARY"
fi
# Whether a stream waiting on a dead peer's IPC event waits for ever (the
# hazard docs/reliability.md names, never provoked; the fake driver does
# what we tell it).
if wanted peer_death && optional peer_death 45 35; then
  step peer_death "$OUT/bench.log" "$secs" "$PY" tools/gpu_peer_death.py ||
    failed=$((failed + 1))
  # "peer death: {"check": "ipc_event_peer_death", "waiter": "stuck", ...}"
  grep '"check": "ipc_event_peer_death"' "$OUT/bench.log" | tail -n 1 |
    sed 's/^/peer death: /' | tee -a "$SUMMARY"
fi
if wanted mps_bench || wanted mps_breakdown; then
  if [ "$FAKE" = 1 ]; then
    note mps_bench skip 0 "no GPU (--fake)"
  elif ! command -v nvidia-cuda-mps-control >/dev/null; then
    note mps_bench skip 0 "no nvidia-cuda-mps-control on this machine"
  else
    mps=/tmp/gpu_check_mps
    mkdir -p "$mps/pipe" "$mps/log"
    rm -f "$mps/cuda_bench.jsonl" # never an earlier call's rows
    export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
    secs=$(limit 100 0)
    if [ "$secs" -lt 20 ]; then
      note mps_bench skip 0 "no time left in the budget (optional)"
    elif nvidia-cuda-mps-control -d >>"$OUT/bench.log" 2>&1; then
      # The daemon goes with the script, however the script ends.
      trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
      read -ra bench <<<"$BENCH_ARGS"
      if wanted mps_bench; then
        step mps_bench "$OUT/bench.log" "$(limit 100 45)" \
          "$PY" benchmarks/cuda_bench.py "${bench[@]}" --main-plans-only \
          --cases identity_4KB identity_4MB identity_400MB many_1000x1KB strided_32MB cpu_4KB \
          --out "$mps/cuda_bench.jsonl" || failed=$((failed + 1))
        ratios "$mps/cuda_bench.jsonl" "mps "
      fi
      # Where a CUDA call's extra over a CPU call goes with the GPU's
      # time-slicing out of the way (session 39: +146 us, callee_run +52 of
      # it, unsplit then); its rows go to bench.log.
      if wanted mps_breakdown; then
        secs=$(limit 45 0)
        if [ "$secs" -lt 15 ]; then
          note mps_breakdown skip 0 "no time left in the budget (optional)"
        else
          step mps_breakdown "$OUT/bench.log" "$secs" \
            "$PY" benchmarks/cuda_call_breakdown.py --calls 300 \
            --cases cpu_4KB cuda_4KB self_4KB || failed=$((failed + 1))
          # "mps callee_run parts (us): cuda_4KB callee_call 60.1 ..."
          sed -n 's/.*"case": "\([A-Za-z0-9_]*\)", "part": "\([a-z_]*\)", "of": "callee_run", "median_us": \([0-9.]*\).*/\1 \2 \3/p' \
            "$OUT/bench.log" | tail -n 6 |
            awk '{ s = s " " $1 " " $2 " " $3 } END { if (s != "") print "mps callee_run parts (us):" s }' |
            tee -a "$SUMMARY"
        fi
      fi
      echo quit | nvidia-cuda-mps-control >>"$OUT/bench.log" 2>&1
      trap - EXIT
    else
      note mps_bench skip 0 "the MPS daemon did not start (bench.log)"
    fi
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi

echo "failed steps: $failed; ${SECONDS} s in all" | tee -a "$SUMMARY"
exit "$failed"
