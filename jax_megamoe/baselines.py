"""A pure-JAX peer of `moe_ffn` to compare against: sort the (token, k) pairs by expert, two grouped matmuls,
weighted scatter-add back. It has `moe_ffn`'s positional signature, so it plugs into
`jax_megamoe.nn.MoE(implementation=ragged_dot_moe_ffn)` and the models (the training job's `--implementation
ragged_dot`, the training benchmark's peers, with another grouped matmul through `ragged_dot`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_megamoe import reference

# `ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G] int32) -> [M, N]`, as `jax.lax.ragged_dot`.
RaggedDot = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def ragged_dot_moe_ffn(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    ragged_dot: RaggedDot = jax.lax.ragged_dot,
) -> jax.Array:
    """`y[t] = sum_k weights[t, k] * f_{experts[t, k]}(x[t])` with two `ragged_dot` grouped matmuls over the pairs
    sorted by expert; ids outside `[0, E)` contribute zero (and get zero gradient)."""
    top_k, num_experts = experts.shape[1], w_gate_up.shape[0]
    flat = experts.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    order = jnp.argsort(jnp.where(valid, flat, num_experts), stable=True)  # invalid pairs sort last
    token_of_row = order // top_k
    sizes = jnp.bincount(jnp.where(valid, flat, 0), weights=valid.astype(jnp.int32), length=num_experts)
    sizes = sizes.astype(jnp.int32)
    gate_up = ragged_dot(x[token_of_row], w_gate_up, sizes)
    rows = ragged_dot(reference.swiglu(gate_up), w_down, sizes)
    row_weights = jnp.where(valid, weights.reshape(-1), 0)[order].astype(jnp.float32)
    y = jnp.zeros(x.shape, jnp.float32).at[token_of_row].add(rows.astype(jnp.float32) * row_weights[:, None])
    return y.astype(x.dtype)
