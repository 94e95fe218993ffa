#!/usr/bin/env bash
# Trains a small Qwen3-MoE with jax_megamoe's MoE layer: on the GPU(s) if there are any, else on 8 host
# CPU devices. Sets up .venv first (scripts/setup_env.sh: seconds when nothing changed). Arguments go to
# examples/train_qwen3_moe.py (`bash scripts/train.sh --help` lists them); outputs go to ./runs/.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh" nn
exec "$root/.venv/bin/python" "$root/examples/train_qwen3_moe.py" "$@"
