#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# A wheel of torch_rpc_ext for this tree's torch, into OUT_DIR (default
# dist/ of the checkout):
#
#   bash tools/wheel.sh                                  # torch 2.13.0 (.venv)
#   bash tools/with_torch.sh 2.15.0 bash tools/wheel.sh  # torch 2.15.0
#
# Its version names that torch (torch_rpc_ext-0.1.0+torch2.15.0.cu132-...)
# and it requires that release; it holds no test hooks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-}
if [ -z "$out" ]; then
  # The checkout's dist/, also from a tree of tools/with_torch.sh.
  if [ -f .synced-files ]; then out=$(cd ../.. && pwd)/dist; else out=$PWD/dist; fi
fi
SETUP_FOR=demo . tools/setup_env.sh
unset TORCH_RPC_EXT_BUILD_TESTING
MAX_JOBS=${MAX_JOBS:-2} python -m pip wheel -q --no-build-isolation --no-deps -w "$out" . 2>"build/wheel.log" || {
  cat build/wheel.log >&2
  exit 1
}
ls "$out"/torch_rpc_ext-*+torch"$(python -c 'import torch; print(torch.__version__.replace("+", "."))')"-*.whl
