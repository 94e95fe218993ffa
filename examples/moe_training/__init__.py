"""Pieces of the example jobs: training (examples/train_qwen3_moe.py), sampling (generate_qwen3_moe.py) and RL
post-training (rl_qwen3_moe.py)."""
