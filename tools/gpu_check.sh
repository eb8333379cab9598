#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The project's GPU check, for a machine with an NVIDIA GPU and a CUDA torch
# (see docs/cuda.md, "Checking on a GPU"). From the project root:
#   bash tools/gpu_check.sh [PYTEST_ARGS...]
# Steps, each logged under $OUT (default /tmp/gpu_check), each timed:
#   1. wheels carried in .whl/ (numpy<2.5, expecttest; ../shared/tools/
#      gpu_wheels.sh fetches them) go to /tmp/site, ahead of the system's;
#   2. the extension builds in place against the machine's torch;
#   3. the copy kernels' PTX is made there by numba-cuda (to show numba-cuda
#      works there; what loads is the PTX the package ships, ISA 6.0);
#   4. tools/gpu_probe.py times the copy engine beside torch and checks
#      CUDA IPC of memory and events between two processes (probe.log);
#   5. pytest runs the CUDA tests (tests/cuda*) and the given arguments;
#   6. benchmarks/cuda_bench.py, ours and TensorPipe (cuda_bench.jsonl,
#      cuda_bench.png, a ratio per case);
#   7. upstream's CUDA suites (tests/conformance_cuda, spawned processes),
#      each test cut at 120 s and the step at 420 s.
# STEPS="ptx probe pytest bench upstream_cuda" (the default: all) runs only
# those after the build, so that one device call's 10 minutes need not hold
# them all: a second call on the still-warm machine rebuilds nothing.
# Exit status: the number of failed steps (0 = all passed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
failed=0
STEPS=${STEPS:-ptx probe pytest bench upstream_cuda}
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, time it
  local name=$1 start rc
  shift
  case " build $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  start=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(($(date +%s) - start))}" |
    tee -a "$OUT/steps.jsonl"
  [ "$rc" -eq 0 ] || { failed=$((failed + 1)); tail -n 40 "$OUT/$name.log"; }
  return "$rc"
}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    --upgrade .whl/*.whl >"$OUT/wheels.log" 2>&1 || { cat "$OUT/wheels.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TORCH_RPC_EXT_BUILD_TESTING=1
export TORCH_RPC_EXT_CACHE_DIR=/tmp/torch_rpc_ext_cache
{ nvidia-smi; python3 -m pip list 2>/dev/null | grep -iE '^(torch|numba|numpy|nvidia|cuda)'; } \
  >"$OUT/machine.txt" 2>&1
step build env MAX_JOBS=${MAX_JOBS:-14} python3 setup.py build_ext --inplace
step ptx python3 -m torch_rpc_ext._cuda.ptx --out /tmp/gpu_ptx
step probe python3 tools/gpu_probe.py --ptx torch_rpc_ext/_cuda/shipped_ptx
step pytest python3 -m pytest -p no:cacheprovider -q --timeout 300 -rfE \
  $(ls -d tests/cuda* 2>/dev/null) "$@"
[ -f "$OUT/pytest.log" ] && tail -n 5 "$OUT/pytest.log"
rm -f "$OUT/cuda_bench.jsonl" "$OUT/cuda_bench.png"
step bench python3 benchmarks/cuda_bench.py --out "$OUT/cuda_bench.jsonl" \
  --chart "$OUT/cuda_bench.png"
[ -f "$OUT/cuda_bench.jsonl" ] && grep '"ratio"' "$OUT/cuda_bench.jsonl"
step upstream_cuda env DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=60 timeout 420 \
  python3 -m pytest -p no:cacheprovider -q --timeout 120 -rfE tests/conformance_cuda
[ -f "$OUT/upstream_cuda.log" ] && tail -n 3 "$OUT/upstream_cuda.log"
exit "$failed"
