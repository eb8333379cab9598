#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Run a command of this checkout against another torch:
#
#   bash tools/with_torch.sh 2.15.0 bash tools/test.sh tests/conformance
#   bash tools/with_torch.sh 2.14.1 bash tools/demo.sh --epochs 2
#
# An extension is built for one torch and lands in the package folder under
# a name that does not say which, so each torch gets a tree of its own:
# build/torch-VERSION/, a copy of this checkout's sources as they are on
# disk (tools/sync_tree.py, which copies only what changed), with its own
# .venv (that torch, installed by tools/setup_env.sh from the registry if
# need be) and its own build. The command runs there, with
# TORCH_RPC_EXT_TORCH=VERSION. The first run downloads torch (a CUDA build
# is a few GB) and builds; later ones rebuild what changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$#" -lt 2 ]; then
  echo "usage: bash tools/with_torch.sh TORCH_VERSION COMMAND [ARGS...]" >&2
  exit 2
fi
version=$1
shift
if ! [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "with_torch.sh: a torch release is X.Y.Z, not '$version'" >&2
  exit 2
fi
tree=build/torch-$version
python3 tools/sync_tree.py "$tree" >&2
cd "$tree"
echo "with_torch.sh: torch $version in $PWD: $*" >&2
TORCH_RPC_EXT_TORCH=$version exec "$@"
