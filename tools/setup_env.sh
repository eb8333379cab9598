#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Create .venv (if missing), install the pinned toolchain, build torch_rpc_ext.
# Idempotent: a second run only rebuilds what changed. Sourced by demo.sh/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel >/dev/null
python -m pip install -q "torch==2.13.0" numpy pytest pytest-timeout expecttest hypothesis grpcio \
  matplotlib nbclient ipykernel gymnasium  # tutorials/ run in a Jupyter kernel; 01 uses gymnasium
MAX_JOBS=${MAX_JOBS:-2} python -m pip install -q --no-build-isolation -e .
python -c "import torch_rpc_ext" # fail here, not in the first test, if the build is broken
