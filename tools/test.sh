#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The test suite: unit tests, two-process tests, upstream's RPC conformance
# suites on TORCH_RPC_EXT. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. tools/setup_env.sh
python -m pytest -p no:cacheprovider -q --timeout 900 tests "$@"
