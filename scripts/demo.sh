#!/usr/bin/env bash
# The README's first command: install redroll (with CPU torch) into the checkout's .venv (made
# when missing, from any python3: see .ci/python-env) and run `redroll demo` on the embedded
# default. Arguments go to `redroll demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
. .ci/python-env
"$PY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
# CPU torch pinned first, so nothing pulls a multi-GB CUDA build.
"$PY" -m pip install --quiet "torch==2.13.0" -e ".[cpu]"
exec "$PY" -m redroll.cli demo "$@"
