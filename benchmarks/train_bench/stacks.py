"""The stacks the benchmark can run, those it runs by default, and their labels."""

from __future__ import annotations

STACKS = (
    "ours",
    "ours_lce",
    "ours_remat",
    "ours_lce_remat",
    "ours_unrolled",
    "ours_fp8",
    "tokamax",
    "ragged_dot",
    "torch",
)
# The peers run right after our first row, so that a run cut short still holds all three stacks.
DEFAULT_STACKS = ("ours", "tokamax", "torch", "ours_lce", "ours_lce_remat", "ours_unrolled", "ours_fp8")
DEFAULT_BREAKDOWN = ("ours", "ours_lce")


def stack_label(name: str, param_dtype: str) -> str:
    pd = "bf16" if name in ("tokamax", "ragged_dot", "torch") else {"float32": "f32", "bfloat16": "bf16"}[param_dtype]
    labels = {
        "ours": "ours, optax CE",
        "ours_lce": "ours, linear_cross_entropy",
        "ours_remat": "ours remat+save-moe, optax CE",
        "ours_lce_remat": "ours remat+save-moe, linear_cross_entropy",
        "ours_unrolled": "ours unrolled layers, optax CE",
        "ours_fp8": "ours FP8 blockwise experts, optax CE",
        "tokamax": "JAX + sort + tokamax ragged_dot",
        "ragged_dot": "JAX + sort + lax.ragged_dot",
        "torch": "transformers grouped_mm + fused AdamW",
    }
    return f"{labels[name]} ({pd} params)"
