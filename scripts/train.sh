#!/usr/bin/env bash
# Installs jax_megamoe into .venv and trains a small Qwen3-MoE on the GPU if there is one, else on CPU.
# Arguments go to examples/train_qwen3_moe.py (--help lists them).
set -euo pipefail
EXTRAS=nn
. "$(dirname "$0")/setup_env.sh"
exec python examples/train_qwen3_moe.py "$@"
