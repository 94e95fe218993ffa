"""Pure-JAX reference of every op: the semantics all kernels are tested against.

Written for clarity, not speed: per-expert dense masks instead of sorting. Everything runs in the
inputs' dtype promoted to at least float32 (float64 stays float64), with full-precision matmuls on every
platform, so the reference is exact to that precision and differentiable with `jax.grad`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _compute_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def route(router_logits: jax.Array, top_k: int, norm_topk_prob: bool = True, recorded: jax.Array | None = None):
    """Qwen3-MoE routing: softmax over all experts in float32, top-k, optional renormalisation.

    Returns `(weights [T, K] float32, experts [T, K] int32)`; experts are in descending probability,
    ties broken toward the lower expert id.

    `recorded [T, K]` (integer; routing replay) replaces the top-k of every token whose row holds an id other than
    -1 by that row's ids, weighted by this router's probabilities at them (renormalised over the row's ids in
    `[0, E)` with `norm_topk_prob`); a row of -1 keeps its own top-k. Ids outside `[0, E)` in a recorded row get
    weight 0 and are dropped by `moe_ffn`.
    """
    probs = jax.nn.softmax(router_logits.astype(_compute_dtype(router_logits.dtype)), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    experts = experts.astype(jnp.int32)
    if recorded is not None:
        num_experts = probs.shape[-1]
        recorded = recorded.astype(jnp.int32)
        replayed = jnp.any(recorded != -1, axis=-1, keepdims=True)
        valid = (recorded >= 0) & (recorded < num_experts)
        at_recorded = jnp.take_along_axis(probs, jnp.clip(recorded, 0, num_experts - 1), axis=-1)
        weights = jnp.where(replayed, jnp.where(valid, at_recorded, 0), weights)
        experts = jnp.where(replayed, recorded, experts)
    if norm_topk_prob:
        total = jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights / jnp.where(total > 0, total, 1)
    return weights.astype(jnp.promote_types(probs.dtype, jnp.float32)), experts


def swiglu(gate_up: jax.Array) -> jax.Array:
    """`silu(gate) * up` for `gate_up = concat([gate, up], -1)`."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    # HIGHEST: GPUs otherwise run float32 products in tf32, which would make the reference inexact.
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def expert_mlp(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """One expert's SwiGLU MLP: `(silu(x @ Wg) * (x @ Wu)) @ Wd`, at full matmul precision."""
    return _matmul(swiglu(_matmul(x, w_gate_up)), w_down)


def moe_ffn(x, weights, experts, w_gate_up, w_down):
    """`y[t] = sum_k weights[t, k] * f_{experts[t, k]}(x[t])`.

    Pairs whose expert id lies outside `[0, E)` contribute zero (the kernels drop them too).
    Accumulates in float32 (or float64), returns x's dtype.
    """
    cdt = _compute_dtype(x.dtype)
    xc = x.astype(cdt)
    num_experts = w_gate_up.shape[0]
    y = jnp.zeros(x.shape, cdt)
    for e in range(num_experts):
        gate = jnp.sum(jnp.where(experts == e, weights.astype(cdt), 0), axis=-1)
        y = y + gate[:, None] * expert_mlp(xc, w_gate_up[e].astype(cdt), w_down[e].astype(cdt))
    return y.astype(x.dtype)


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
    """Number of (token, k) pairs routed to each expert, `[E]` int32 (out-of-range ids not counted)."""
    return jnp.sum(jax.nn.one_hot(experts.reshape(-1), num_experts, dtype=jnp.int32), axis=0)


def load_balancing_loss(router_logits: jax.Array, experts: jax.Array) -> jax.Array:
    """Switch/HF auxiliary loss `E * sum_e (c_e / T) * P_e`; equals K at perfect balance.

    `c_e` counts the top-k slots routed to expert e, `P_e` is the mean router probability of e.
    """
    num_tokens, num_experts = router_logits.shape
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    counts = expert_counts(experts, num_experts).astype(jnp.float32)
    return num_experts * jnp.sum((counts / num_tokens) * jnp.mean(probs, axis=0))


def router_z_loss(router_logits: jax.Array) -> jax.Array:
    """`mean(logsumexp(logits) ** 2)` over tokens."""
    return jnp.mean(jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1) ** 2)
