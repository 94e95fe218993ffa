"""Model FLOPs per training step, and the rates of a row: tokens/s, model TFLOP/s and MFU."""

from __future__ import annotations


def train_flops_per_step(config, batch: int, seq: int) -> float:
    """`jax_megamoe.training.train_flops_per_token` (what the training job counts) times the step's tokens."""
    from jax_megamoe import training

    return training.train_flops_per_token(config, seq) * batch * seq


def with_rates(row: dict, tokens_per_step: int, flops_per_step: float, matmul_tflops: float | None) -> dict:
    if row.get("status") == "ok" and row.get("median_step_ms"):
        seconds = row["median_step_ms"] / 1e3
        row["tokens_per_s"] = tokens_per_step / seconds
        row["model_tflops"] = flops_per_step / seconds / 1e12
        row["mfu"] = row["model_tflops"] / matmul_tflops if matmul_tflops else None
    if row.get("peak_memory_bytes") is not None:
        row["peak_memory_gib"] = row["peak_memory_bytes"] / 2**30
    return row
