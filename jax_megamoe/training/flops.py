"""Model FLOPs of a Qwen3-MoE training step and its model FLOP utilisation (MFU).

    FLOPs per token = 6 * N_active + 6 * L * S * n_heads * head_dim

`N_active` counts the matmul parameters one token passes through (`active_params_per_token`); 6 = 2 (multiply-add)
x 3 (the forward and two backward matmuls). The second term is attention's QK^T and PV (4 * S * n_heads * head_dim
per layer forward) halved by the causal mask, times 3. MFU is the FLOPs per second over the devices' peak.
"""

from __future__ import annotations

import typing

from jax_megamoe.models.qwen3_moe_config import Qwen3MoeConfig

# Dense bf16 matmul FLOP/s per device, the MFU denominator, by device kind: measured bf16 matmul rates (the 8192^3
# product of benchmarks/README.md), not the datasheets'. Other devices: pass the peak to `peak_flops`.
PEAK_FLOPS = {"H200": 785e12, "H100": 771e12}


def active_params_per_token(config: Qwen3MoeConfig) -> int:
    """Matmul parameters one token passes through: the attention projections, the router and its top-k experts (or
    the dense MLP) of each layer, and the LM head. Embedding lookups and norms are not matmuls."""
    hidden, head_dim = config.hidden_size, _head_dim(config)
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    total = config.vocab_size * hidden
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            mlp = hidden * config.num_experts + config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
        else:
            mlp = 3 * hidden * config.intermediate_size
        total += attention + mlp
    return total


def train_flops_per_token(config: Qwen3MoeConfig, seq: int) -> float:
    """Training FLOPs per token of sequences of `seq` tokens (the formula above)."""
    attention = 6 * config.num_hidden_layers * seq * config.num_attention_heads * _head_dim(config)
    return float(6 * active_params_per_token(config) + attention)


def _head_dim(config: Qwen3MoeConfig) -> int:
    return typing.cast(int, config.head_dim)  # the config sets it from the widths where it is not given


def peak_flops(device_kind: str, override_tflops: float | None = None) -> float | None:
    """The MFU denominator of one device of `device_kind` (`jax.devices()[0].device_kind`) in FLOP/s: the
    `override_tflops` given, else `PEAK_FLOPS`' entry, else None. For a mesh, multiply by its devices."""
    if override_tflops:
        return override_tflops * 1e12
    return next((flops for kind, flops in PEAK_FLOPS.items() if kind in device_kind), None)
