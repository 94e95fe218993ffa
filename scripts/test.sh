#!/usr/bin/env bash
# Installs jax_megamoe with its test extras into .venv and runs the CPU test suite (GPU tests: -m gpu).
set -euo pipefail
EXTRAS=test
. "$(dirname "$0")/setup_env.sh"
exec pytest -n "${PYTEST_WORKERS:-2}" "$@"
