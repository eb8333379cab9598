#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Create .venv (if missing), install the pinned toolchain, build torch_rpc_ext.
# Idempotent and quick the second time: packages are installed again only
# when the list below (or the Python) changed, and the build is incremental
# (objects kept in build/temp-*). Sourced by demo.sh/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
PACKAGES=(
  "torch==2.13.0" numpy pytest pytest-timeout expecttest hypothesis grpcio
  matplotlib nbclient ipykernel gymnasium  # tutorials/ run in a Jupyter kernel; 01 uses gymnasium
  numba "numba-cuda==0.30.4" "nvidia-nvvm==13.0.*" "nvidia-cuda-nvrtc==13.0.*" "numpy<2.5"  # torch_rpc_ext/_cuda: copy kernels to PTX, no GPU needed; numba-cuda 0.30.4 breaks on numpy 2.5
  "nvidia-cuda-runtime==13.0.*"  # cuda.h, for building (csrc/common/libcuda.h); no GPU needed
)
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.packages-$(printf '%s\n' "${PACKAGES[@]}" "$(python -VV)" | sha1sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip setuptools wheel >/dev/null
  python -m pip install -q "${PACKAGES[@]}"
  rm -f .venv/.packages-*
  touch "$stamp"
fi
# Built against the torch just installed (no build isolation), with the test
# hooks (torch_rpc_ext._testing, never in a wheel). The editable install
# once; after it, an in-place build recompiles only what changed.
export TORCH_RPC_EXT_BUILD_TESTING=1
if compgen -G ".venv/lib/python*/site-packages/__editable__.torch_rpc_ext-*.pth" >/dev/null; then
  MAX_JOBS=${MAX_JOBS:-2} python setup.py -q build_ext --inplace >/dev/null
else
  MAX_JOBS=${MAX_JOBS:-2} python -m pip install -q --no-build-isolation --no-deps -e .
fi
python -c "import torch_rpc_ext, torch_rpc_ext._testing" # fail here, not in the first test, if the build is broken
