#!/usr/bin/env bash
# Runs the CPU test suite (GPU tests: -m gpu) from the repository root, in PYTEST_WORKERS processes
# (default 2). Sets up .venv with the test extras first (scripts/setup_env.sh: seconds when nothing
# changed). Arguments go to pytest, e.g. `bash scripts/test.sh -x -q tests/test_routing.py`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh" test
cd "$root"
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
