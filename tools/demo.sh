#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The main job: a trainer and a parameter server on this machine train a model
# split across them over TORCH_RPC_EXT (distributed autograd + DistributedOptimizer).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. tools/setup_env.sh
exec python -m torch_rpc_ext.demo "$@"
