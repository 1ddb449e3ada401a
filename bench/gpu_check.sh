#!/usr/bin/env bash
# The one command an instructor runs on a GPU node (see bench/gpu_check.py for the rows):
#   bash bench/gpu_check.sh [--quick] [--only tests,notebooks,single,compile,predict]
# Uses the lab's .venv when there is one, else the python3 on the PATH (a node's own torch).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
exec "$PY" bench/gpu_check.py "$@"
