#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# The main job: a trainer and a parameter server on this machine train a model
# split across them over TORCH_RPC_EXT (distributed autograd + DistributedOptimizer).
# The first run sets up .venv with torch and builds the core (no test
# toolchain, no test hooks): a few minutes; later runs start at once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SETUP_FOR=demo . tools/setup_env.sh
exec python -m torch_rpc_ext.demo "$@"
