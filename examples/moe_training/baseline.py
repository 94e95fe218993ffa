"""The pure-JAX MoE baseline: sort the (token, k) pairs by expert, two `jax.lax.ragged_dot` grouped matmuls,
weighted scatter-add back. Same positional signature as `jax_megamoe.moe_ffn`, so it plugs into
`jax_megamoe.nn.MoE(implementation=ragged_dot_ffn)`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_megamoe import reference


def ragged_dot_ffn(x, weights, experts, w_gate_up, w_down):
    """`y[t] = sum_k weights[t, k] * f_{experts[t, k]}(x[t])` with `jax.lax.ragged_dot`; ids outside
    `[0, E)` contribute zero."""
    top_k = experts.shape[1]
    num_experts = w_gate_up.shape[0]
    flat = experts.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    order = jnp.argsort(jnp.where(valid, flat, num_experts), stable=True)  # invalid pairs sort last
    token_of_row = order // top_k
    group_sizes = jnp.bincount(jnp.where(valid, flat, 0), weights=valid.astype(jnp.int32), length=num_experts)
    gate_up = jax.lax.ragged_dot(x[token_of_row], w_gate_up, group_sizes)
    rows = jax.lax.ragged_dot(reference.swiglu(gate_up), w_down, group_sizes)
    row_weights = jnp.where(valid, weights.reshape(-1), 0)[order].astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32).at[token_of_row].add(rows.astype(jnp.float32) * row_weights[:, None])
    return y.astype(x.dtype)
