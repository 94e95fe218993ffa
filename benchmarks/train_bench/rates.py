"""Model FLOPs per training step, and the rates of a row: tokens/s, model TFLOP/s and MFU."""

from __future__ import annotations


def active_params_per_token(config) -> int:
    """Matmul parameters one token passes through: attention projections, router, its top-k experts (or the
    dense MLP) per layer, and the LM head (embedding lookups and norms are no matmuls)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    total = config.vocab_size * hidden
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            total += (
                hidden * config.num_experts + config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
            )
        else:
            total += 3 * hidden * config.intermediate_size
        total += attention
    return total


def train_flops_per_step(config, batch: int, seq: int) -> float:
    """`(6 * N_active + 6 * L * S * heads * head_dim) * tokens`: 2 (multiply-add) x 3 (forward and two
    backward matmuls) per active parameter; attention's QK^T and PV (4 S heads head_dim per token and
    layer forward) halved by the causal mask, times 3. The examples' training metrics count the same."""
    attention = 6 * config.num_hidden_layers * seq * config.num_attention_heads * config.head_dim
    return float((6 * active_params_per_token(config) + attention) * batch * seq)


def with_rates(row: dict, tokens_per_step: int, flops_per_step: float, matmul_tflops: float | None) -> dict:
    if row.get("status") == "ok" and row.get("median_step_ms"):
        seconds = row["median_step_ms"] / 1e3
        row["tokens_per_s"] = tokens_per_step / seconds
        row["model_tflops"] = flops_per_step / seconds / 1e12
        row["mfu"] = row["model_tflops"] / matmul_tflops if matmul_tflops else None
    if row.get("peak_memory_bytes") is not None:
        row["peak_memory_gib"] = row["peak_memory_bytes"] / 2**30
    return row
