"""Models built on jax_megamoe layers: `qwen3_moe` (Qwen3-MoE with Hugging Face checkpoint I/O)."""
