#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The test suite: upstream's RPC conformance suites on TORCH_RPC_EXT, our
# multi-process tests, the in-process unit tests, then a bounded round of the
# libFuzzer targets. Arguments, if any, are passed to a single pytest run
# instead (`bash tools/test.sh tests/rpc/test_exit.py`): with .venv set up,
# that reinstalls nothing and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. tools/setup_env.sh
# Upstream's per-test limit for multi-process tests (default 300 s); every
# test here takes seconds, so a hang is cut short sooner.
export DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=${DISTRIBUTED_TESTS_DEFAULT_TIMEOUT:-180}
if [ "$#" -gt 0 ]; then
  exec python -m pytest -p no:cacheprovider -q --timeout 900 "$@"
fi
# Multi-process tests fork from the pytest process; it must not have run
# torch compute first (a forked child inherits ATen's started thread pools and
# aborts or hangs on first use), so unit tests get a process of their own.
# Same-host peers use the shm transport by default; the conformance suites
# run again with it forced off, over TCP only.
python -m pytest -p no:cacheprovider -q --timeout 900 tests/conformance tests/rpc tests/scripting tests/launcher \
  tests/wheel tests/tutorials tests/cuda_kernels tests/conformance_cuda
TORCH_RPC_EXT_TRANSPORTS=tcp \
  python -m pytest -p no:cacheprovider -q --timeout 900 tests/conformance
# Upstream's fault-injection suites: a process of their own (see the module).
python -m pytest -p no:cacheprovider -q --timeout 900 tests/faulty
# With them, the fake CUDA driver's own tests (they load it in this process)
# and the driver layer's against it (in spawned processes).
python -m pytest -p no:cacheprovider -q --timeout 300 tests/unit tests/cuda_fake tests/cuda_driver
# The in-process fuzzers (tests/fuzz; docs/reliability.md, "In-process
# fuzzing"): build them (clang-14 + libFuzzer, ASan + UBSan), then a bounded
# round of about a minute over the parsers a peer reaches, from the seed
# corpus. Any finding fails the run.
bash tests/fuzz/run.sh
