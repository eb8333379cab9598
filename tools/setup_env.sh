#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Create .venv (if missing), install torch and what the caller needs, build
# torch_rpc_ext. Sourced by demo.sh (SETUP_FOR=demo) and test.sh (the
# default, SETUP_FOR=test). Idempotent and quick the second time: packages
# are installed again only when the list (or the Python) changed, and the
# build is incremental (objects kept in build/temp-*).
#
#   SETUP_FOR=demo   torch, cuda.h and the core extension: what the demo runs
#   SETUP_FOR=test   the whole test toolchain and the test hooks (_testing)
#
# TORCH_RPC_EXT_TORCH picks the torch (default below, the one CI runs the
# whole suite on). This script installs exactly that release, from the
# registry if need be: the pip configuration's own cap on torch, if the
# machine has one, is lifted for this install (the pin is the project's
# choice, and the script says which torch it installed). Another torch than
# the default belongs in its own tree (tools/with_torch.sh), never in the
# checkout's .venv: an extension is built for one torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
DEFAULT_TORCH=2.13.0
TORCH_VERSION=${TORCH_RPC_EXT_TORCH:-$DEFAULT_TORCH}
SETUP_FOR=${SETUP_FOR:-test}
# What the multi-process stages need on any torch.
TEST_PACKAGES=(numpy pytest pytest-timeout expecttest hypothesis grpcio matplotlib)
# The rest of the suite, on the default (CPU) torch: tutorials/ run in a
# Jupyter kernel (01 uses gymnasium); torch_rpc_ext/_cuda compiles the copy
# kernels to PTX and runs them in numba's simulator, no GPU needed
# (numba-cuda 0.30.4 breaks on numpy 2.5); torch_rpc_ext.metrics serves
# Prometheus's format through prometheus_client (the [metrics] extra);
# tests/rpc/test_tracing.py records spans with OpenTelemetry's SDK.
FULL_PACKAGES=(
  nbclient ipykernel gymnasium prometheus_client opentelemetry-sdk
  numba "numba-cuda==0.30.4" "nvidia-nvvm==13.0.*" "nvidia-cuda-nvrtc==13.0.*" "numpy<2.5"
)
# torch warns on every process start without numpy.
DEMO=("torch==$TORCH_VERSION" numpy)
TEST=("torch==$TORCH_VERSION" "${TEST_PACKAGES[@]}")
if [ "$TORCH_VERSION" = "$DEFAULT_TORCH" ]; then
  TEST+=("${FULL_PACKAGES[@]}")
fi
case "$SETUP_FOR" in
  demo) PACKAGES=("${DEMO[@]}") ;;
  test) PACKAGES=("${TEST[@]}") ;;
  *) echo "setup_env.sh: SETUP_FOR is demo or test, not '$SETUP_FOR'" >&2; exit 2 ;;
esac
if [ "$TORCH_VERSION" != "$DEFAULT_TORCH" ] && [ ! -f .synced-files ]; then
  echo "setup_env.sh: torch $TORCH_VERSION is not this checkout's ($DEFAULT_TORCH);" \
    "run through tools/with_torch.sh $TORCH_VERSION, which gives it a tree of its own" >&2
  exit 2
fi
# A stamp per package list. The tests' list holds the demo's, so a .venv
# set up for the tests serves the demo as it is.
# ("bytecode": a .venv set up before its packages were byte-compiled below
# is set up again: pip finds them installed, and they are compiled.)
# `stamp KIND PACKAGES...`, of the Python in STAMP_PYTHON (default: the
# one on the path, .venv's once it is activated).
stamp() { echo ".venv/.packages-$1-$(printf '%s\n' "${@:2}" "$("${STAMP_PYTHON:-python}" -VV)" bytecode | sha1sum | cut -c1-16)"; }
# A sanitizer's tree (tools/sanitize.sh sets TORCH_RPC_EXT_BORROW_VENV to
# the checkout's .venv) borrows that .venv's packages when it was set up for
# the same list on the same Python: its own .venv has no pip and reads the
# checkout's site-packages through a .pth file read first (00_...), with
# the checkout's other .pth files copied beside it (numba-cuda's
# redirector, setuptools' distutils shim; not its editable install),
# instead of a second install of torch and the rest (~2 GB, and a minute of
# CPU that a clean run's first lane waited for). What it builds and
# installs (this tree's editable install) goes to its own .venv, which
# comes first on the path. It follows the checkout's packages as they
# change; where the checkout's .venv is not set up for this list, or on
# another Python, the tree installs its own. Only in a tree (.synced-files),
# never over the .venv it would borrow.
borrowed_pth=00_torch_rpc_ext_borrowed.pth
borrow=${TORCH_RPC_EXT_BORROW_VENV:-}
borrow_site=""
if [ -n "$borrow" ] && [ -f .synced-files ] && [ -x "$borrow/bin/python" ] &&
  [ "$(cd "$borrow" && pwd -P)" != "$(pwd -P)/.venv" ] &&
  [ "$("$PYTHON" -VV)" = "$("$borrow/bin/python" -VV)" ] &&
  [ -f "$borrow/$(STAMP_PYTHON=$borrow/bin/python stamp test "${TEST[@]}" | cut -d/ -f2)" ]; then
  borrow_site=$("$borrow/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
fi
# (Made again when a setup was cut off while it made it: a python there
# but no activate script, or no pip, and the stamps below would never
# notice. Seen in build/torch-2.15.0 after a session ended mid-setup. And
# when what it borrows changed: another site-packages, or none.)
borrowing() { cat .venv/lib/python*/site-packages/"$borrowed_pth" 2>/dev/null || true; }
if [ ! -x .venv/bin/python ] || [ ! -f .venv/bin/activate ] ||
  ! .venv/bin/python -c 'import pip' >/dev/null 2>&1 || [ "$(borrowing)" != "$borrow_site" ]; then
  if [ -n "$borrow_site" ]; then
    "$PYTHON" -m venv --clear --without-pip .venv
    echo "$borrow_site" >"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/$borrowed_pth"
    echo "setup_env.sh: $PWD/.venv borrows the packages of $borrow" >&2
  else
    "$PYTHON" -m venv --clear .venv
  fi
fi
# (The borrowed .pth files, as they are now.)
if [ -n "$borrow_site" ]; then
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  for pth in "$borrow_site"/*.pth; do
    [ -f "$pth" ] || continue
    case "$(basename "$pth")" in __editable__* | "$borrowed_pth") ;; *) cp "$pth" "$site/" ;; esac
  done
fi
# shellcheck disable=SC1091
. .venv/bin/activate
ready=$(stamp "$SETUP_FOR" "${PACKAGES[@]}")
if [ "$SETUP_FOR" = demo ] && [ -f "$(stamp test "${TEST[@]}")" ]; then
  ready=$(stamp test "${TEST[@]}")
fi
# (Borrowed: the checkout's .venv was set up for this list.)
[ -z "$borrow_site" ] || touch "$ready"
if [ ! -f "$ready" ]; then
  have=$(python -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
  echo "setup_env.sh: installing torch==$TORCH_VERSION (found: $have) and what the $SETUP_FOR needs into $PWD/.venv" >&2
  python -m pip install -q --upgrade pip setuptools wheel >/dev/null
  # --no-compile: pip compiles one file at a time; compileall below does
  # it on every core.
  if ! PIP_CONSTRAINT=/dev/null python -m pip install -q --no-compile "${PACKAGES[@]}"; then
    # The usual cause is the disk: a CUDA build of torch and its NVIDIA
    # wheels take about 8 GB while they install (downloads and venv).
    free_gb=$(df -Pk . | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }')
    echo "setup_env.sh: installing torch==$TORCH_VERSION and the $SETUP_FOR's packages failed (above); $free_gb GB is free under $PWD (a CUDA build of torch needs about 8 GB)" >&2
    exit 1
  fi
  # cuda.h for the build (csrc/common/libcuda.h; no GPU needed): a CUDA
  # torch brings it with its NVIDIA wheels, a CPU torch does not.
  if ! python torch_rpc_ext/_cuda/headers.py >/dev/null 2>&1; then
    python -m pip install -q "nvidia-cuda-runtime==13.0.*"
  fi
  # crt/ beside it, of the runtime's own release (13.0 beside a CPU torch's
  # 13.0 runtime, 13.2 beside torch 2.15's; c10/cuda includes both): for
  # the CUDA landing pool's routing (csrc/torch_cuda/; 134 KB of
  # headers). A build without it works, with no landing pool.
  if ! python -c 'import runpy, sys; sys.exit(runpy.run_path("torch_rpc_ext/_cuda/headers.py")["crt_include_dir"]() is None)'; then
    runtime=$(python -c 'from importlib import metadata as m; print(".".join(m.version("nvidia-cuda-runtime").split(".")[:2]))' 2>/dev/null || echo 13.0)
    python -m pip install -q "nvidia-cuda-crt==$runtime.*" ||
      echo "setup_env.sh: nvidia-cuda-crt==$runtime.* did not install: building without the CUDA landing pool" >&2
  fi
  # Byte-compiled once here, not by each interpreter: where
  # PYTHONDONTWRITEBYTECODE is set (as on this machine and in CI), Python
  # writes no .pyc itself, and every process that imports torch compiled
  # its ~2,300 modules again: 4.0 s of CPU for `import torch` against 2.2
  # s (2026-12-02, this machine), in each of the ~300 interpreters a test
  # run starts. All of site-packages, ~37 s of CPU on 2 cores; a few files
  # that are not Python 3 (templates, old examples) fail to compile, as
  # they would under pip.
  python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
  rm -f .venv/.packages-"$SETUP_FOR"-*
  touch "$ready"
fi
# Built against the torch just installed (no build isolation). The editable
# install once; after it, an in-place build recompiles only what changed.
# The tests add the test hooks (torch_rpc_ext._testing, never in a wheel).
if [ "$SETUP_FOR" = test ]; then
  export TORCH_RPC_EXT_BUILD_TESTING=1
fi
# A tree of another torch's or of a sanitizer's (a copy, .synced-files) is
# built from clean in each clean run and seldom edited: each source folder
# compiles as one unity unit there (setup.py, TORCH_RPC_EXT_UNITY), a
# quarter less CPU than units of 8 (torch 2.15.0's tree: 240 s of compiles
# against 321). The checkout keeps units of 8 for quick rebuilds.
if [ -f .synced-files ]; then
  export TORCH_RPC_EXT_UNITY=${TORCH_RPC_EXT_UNITY:-64}
fi
# A real Prometheus scrapes a live group in tests/rpc/test_metrics.py:
# Debian's package where apt is there to install it (as root); else that
# test is skipped, saying why.
if [ "$SETUP_FOR" = test ] && [ "$TORCH_VERSION" = "$DEFAULT_TORCH" ] &&
  ! command -v prometheus >/dev/null && command -v apt-get >/dev/null &&
  [ "$(id -u)" = 0 ]; then
  echo "setup_env.sh: installing Debian's prometheus (for tests/rpc/test_metrics.py)" >&2
  export DEBIAN_FRONTEND=noninteractive
  # (Bounded: a machine without a reachable mirror must not hold the run.)
  if ! timeout 300 apt-get install -y -q prometheus >/dev/null 2>&1; then
    timeout 300 apt-get update -q >/dev/null 2>&1 || true
    timeout 300 apt-get install -y -q prometheus >/dev/null 2>&1 ||
      echo "setup_env.sh: could not install prometheus; its test will be skipped" >&2
  fi
fi
mkdir -p build
log=build/setup-build.log
if compgen -G ".venv/lib/python*/site-packages/__editable__.torch_rpc_ext-*.pth" >/dev/null; then
  build=(python setup.py -q build_ext --inplace)
else
  echo "setup_env.sh: building torch_rpc_ext against torch $TORCH_VERSION (a few minutes the first time)" >&2
  build=(python -m pip install -q --no-build-isolation --no-deps -e .)
fi
# The build's output (setuptools' notices included) goes to the log, and
# is shown only if the build fails.
if ! MAX_JOBS=${MAX_JOBS:-2} "${build[@]}" >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup_env.sh: the build failed (log: $PWD/$log)" >&2
  exit 1
fi
# Our own modules too, for the same reason (Python checks a .pyc against its
# source's time and size, so an edited file is never run from a stale one).
python -m compileall -q -j 0 torch_rpc_ext tests benchmarks tools >/dev/null 2>&1 || true
# (A sanitized build, SANITIZE, loads only with its runtime preloaded:
# tools/sanitizer_env.sh, in a subshell so that this shell's programs do not.)
if [ "$SETUP_FOR" = test ]; then
  (. tools/sanitizer_env.sh && python -c "import torch_rpc_ext, torch_rpc_ext._testing") # fail here, not in the first test, if the build is broken
else
  (. tools/sanitizer_env.sh && python -c "import torch_rpc_ext")
fi
