#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The test suite, on both ends of the torch range setup.py declares:
#   - on the oldest tested torch, the default (a CPU build, which the
#     fake-CUDA tests need): upstream's RPC conformance suites on
#     TORCH_RPC_EXT, our multi-process tests, the in-process unit tests,
#     then a bounded round of the libFuzzer targets;
#   - on the newest (NEWEST_TORCH, a CUDA build from the registry, run on
#     the CPU), in a tree of its own (tools/with_torch.sh): upstream's
#     conformance suites over shm and over TCP only, our multi-process tests
#     and the wheel.
# Arguments, if any, are passed to a single pytest run instead (`bash
# tools/test.sh tests/rpc/test_exit.py`): with .venv set up, that reinstalls
# nothing and rebuilds only what changed. `bash tools/with_torch.sh 2.15.0
# bash tools/test.sh ARGS...` does the same against that torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NEWEST_TORCH=2.15.0
SETUP_FOR=test . tools/setup_env.sh
# Upstream's per-test limit for multi-process tests (default 300 s); every
# test here takes seconds, so a hang is cut short sooner.
export DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=${DISTRIBUTED_TESTS_DEFAULT_TIMEOUT:-180}
if [ "$#" -gt 0 ]; then
  exec python -m pytest -p no:cacheprovider -q --timeout 900 "$@"
fi
torch_version=$(python -c 'import torch; print(torch.__version__)')
stage() {
  echo "== tools/test.sh: $1 on torch $torch_version" >&2
}
pytest() {
  python -m pytest -p no:cacheprovider -q "$@"
}

if [ "$TORCH_VERSION" != "$DEFAULT_TORCH" ]; then
  # Another torch (tools/with_torch.sh): upstream's suites over both
  # transports, the tests that start processes and the wheel; the unit
  # tests, the fake-CUDA ones, the tutorials and the fuzzers are the
  # default torch's (the fake CUDA device needs a CPU torch).
  # Of tests/rpc, the tests of our own transports, channels, wire and
  # crypto against hostile or failing peers and at scale are left to the
  # first torch: that code is the same C++ on every torch, and CI's 45
  # minutes hold them once. `bash tools/with_torch.sh VERSION bash
  # tools/test.sh tests/rpc` runs them all.
  stage "conformance over shm, our multi-process tests"
  pytest --timeout 900 tests/conformance tests/rpc tests/scripting tests/launcher tests/wheel \
    --ignore tests/rpc/test_scale.py --ignore tests/rpc/test_soak.py \
    --ignore tests/rpc/test_fuzz.py --ignore tests/rpc/test_benchmark_smoke.py \
    --ignore tests/rpc/test_partition.py --ignore tests/rpc/test_hostile_peers.py \
    --ignore tests/rpc/test_shm_slabs.py --ignore tests/rpc/test_shm_transport.py \
    --ignore tests/rpc/test_libcrypto.py
  stage "conformance over TCP"
  TORCH_RPC_EXT_TRANSPORTS=tcp pytest --timeout 900 tests/conformance
  exit 0
fi

# Multi-process tests fork from the pytest process; it must not have run
# torch compute first (a forked child inherits ATen's started thread pools and
# aborts or hangs on first use), so unit tests get a process of their own.
# Same-host peers use the shm transport by default.
stage "conformance over shm, multi-process tests, wheel, tutorials, CUDA kernels"
pytest --timeout 900 tests/conformance tests/rpc tests/scripting tests/launcher \
  tests/wheel tests/tutorials tests/cuda_kernels tests/conformance_cuda
# (The pass over TCP only is the newest torch's, below: the transports are
# the same C++ on every torch, and CI's 45 minutes hold one such pass.)
# Upstream's fault-injection suites: a process of their own (see the module).
stage "upstream's fault-injection suites"
pytest --timeout 900 tests/faulty
# With them, the fake CUDA driver's own tests (they load it in this process)
# and the driver layer's against it (in spawned processes).
stage "unit tests, the fake CUDA driver, the driver layer"
pytest --timeout 300 tests/unit tests/cuda_fake tests/cuda_driver
# The in-process fuzzers (tests/fuzz; docs/reliability.md, "In-process
# fuzzing"): build them (clang-14 + libFuzzer, ASan + UBSan), then a bounded
# round of about a minute over the parsers a peer reaches, from the seed
# corpus. Any finding fails the run.
stage "fuzzers"
bash tests/fuzz/run.sh
# The newest torch: its own tree, .venv and build.
if [ "${TORCH_RPC_EXT_SKIP_NEWEST:-0}" != 1 ]; then
  # tests/wheel there installs its wheel beside this .venv's torch too.
  TORCH_RPC_EXT_OTHER_TORCH_SITE=$(python -c "import sysconfig; print(sysconfig.get_path('purelib'))") \
    bash tools/with_torch.sh "$NEWEST_TORCH" bash tools/test.sh
fi
