#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Lint: ruff over the Python (rules in pyproject.toml) and clang-format over
# every tracked *.cpp/*.h (style in .clang-format). Any finding fails.
#   tools/lint.sh          check only
#   tools/lint.sh --fix    apply ruff's fixes and clang-format's formatting
# The tools are pinned and installed into .venv (a minimal one, just these
# two, if tools/setup_env.sh has not created it yet).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUFF_VERSION=0.17.6
CLANG_FORMAT_VERSION=23.1.5

fix=0
case "${1:-}" in
  "") ;;
  --fix) fix=1 ;;
  *) echo "usage: tools/lint.sh [--fix]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
ruff_has=$(.venv/bin/ruff --version 2>/dev/null || true)
clang_format_has=$(.venv/bin/clang-format --version 2>/dev/null || true)
if [ "$ruff_has" != "ruff $RUFF_VERSION" ] ||
  [[ "$clang_format_has " != *"version $CLANG_FORMAT_VERSION "* ]]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check \
    "ruff==$RUFF_VERSION" "clang-format==$CLANG_FORMAT_VERSION"
fi

status=0
if [ "$fix" = 1 ]; then
  .venv/bin/ruff check --fix . || status=1
  git ls-files -z -- '*.cpp' '*.h' |
    xargs -0 -r .venv/bin/clang-format -i || status=1
else
  .venv/bin/ruff check . || status=1
  git ls-files -z -- '*.cpp' '*.h' |
    xargs -0 -r .venv/bin/clang-format --dry-run -Werror || status=1
fi
if [ "$status" != 0 ]; then
  echo "lint: findings above (tools/lint.sh --fix applies what can be fixed)" >&2
fi
exit "$status"
