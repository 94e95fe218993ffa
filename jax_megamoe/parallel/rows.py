"""Moving token rows between token order and per-destination send buffers, deterministically.

`dispatch_rows` (gather tokens into `[ep, C, F]` slots) and `combine_rows` (sum each token's returned
rows over destinations) are each other's transposes. Both are written as gathers, and each one's VJP
is the other, so neither the forward nor the backward needs a floating-point scatter-add with
colliding indices (which runs with atomics, in no fixed order, on GPUs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_megamoe import _ffi


def _accumulation_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


@jax.custom_vjp
def dispatch_rows(x: jax.Array, token: jax.Array, slot: jax.Array) -> jax.Array:
    """`out[d, c] = x[token[d, c]]`, zero where `token[d, c]` is out of range. `x [T, F]` -> `[ep, C, F]`.

    `slot [T, ep]` is the inverse map (slot of token t at destination d, or -1); it defines the VJP.
    """
    return x.at[token].get(mode="fill", fill_value=0)


@jax.custom_vjp
def combine_rows(rows: jax.Array, slot: jax.Array, token: jax.Array) -> jax.Array:
    """`out[t] = sum_d rows[d, slot[t, d]]` over the destinations that hold t, in order d = 0, 1, ...

    Accumulates in float32 (or wider) and returns `rows`' dtype. `rows [ep, C, F]` -> `[T, F]`.
    """
    capacity = rows.shape[1]
    slot = jnp.where(slot >= 0, slot, capacity)  # -1 would wrap around; `capacity` is out of range: zero
    return _sum_in_order([rows[d].at[slot[:, d]].get(mode="fill", fill_value=0) for d in range(rows.shape[0])])


def sum_blocks(rows: jax.Array) -> jax.Array:
    """`out[t] = sum_d rows[d, t]` in order d = 0, 1, ...: `combine_rows` when every token sits at its own row
    and the rows of the destinations that do not hold it are zero (uncompacted plans, `plan.make_plan`). The
    definition of what the nvlink transport's overlapped calls compute in their handlers for such plans
    (`CombineRowsIntoSum` and `SumBlocks`, jmm/moe_cuda.h), kept here as their pure-JAX statement."""
    return _sum_in_order(list(rows))


def _sum_in_order(parts: list[jax.Array]) -> jax.Array:
    """The parts' sum accumulated in float32 (or wider) in list order, so that every way of combining rows
    rounds alike; returns their dtype."""
    acc = jnp.zeros(parts[0].shape, _accumulation_dtype(parts[0].dtype))
    for part in parts:
        acc = acc + part.astype(acc.dtype)
    return acc.astype(parts[0].dtype)


@jax.custom_vjp
def gradient_channel(x: jax.Array, token: jax.Array, slot: jax.Array) -> jax.Array:
    """Zeros shaped as `dispatch_rows(x, token, slot)` (x's dtype) with `dispatch_rows`' VJP: a path for the rows'
    gradient where the rows themselves travel in another form (quantised: `fp8_rows.py`)."""
    # An empty sum of x's: zero, but mapped as x is under jax.vmap (an exchange of an unmapped constant is not).
    zeros = jnp.broadcast_to(jnp.sum(x[:0], dtype=x.dtype), token.shape + x.shape[1:])
    return _ffi.vary_alike(x, zeros)[1]


def _dispatch_fwd(x, token, slot):
    return dispatch_rows(x, token, slot), (token, slot)


def _dispatch_bwd(residuals, d_out):
    token, slot = residuals
    return combine_rows(d_out, slot, token), None, None


def _combine_fwd(rows, slot, token):
    return combine_rows(rows, slot, token), (slot, token)


def _combine_bwd(residuals, d_out):
    slot, token = residuals
    return dispatch_rows(d_out, token, slot), None, None


def _channel_fwd(x, token, slot):
    return gradient_channel(x, token, slot), (token, slot)


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)
gradient_channel.defvjp(_channel_fwd, _dispatch_bwd)
combine_rows.defvjp(_combine_fwd, _combine_bwd)
