"""Pieces of the Qwen3-MoE training example (examples/train_qwen3_moe.py)."""
