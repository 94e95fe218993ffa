# Sourced by train.sh and test.sh: creates .venv once and installs jax_megamoe into it with EXTRAS.
# Building compiles the C++ extension, and the CUDA kernels too where nvcc is found (JMM_CUDA=OFF skips them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet ".[${EXTRAS}]"
