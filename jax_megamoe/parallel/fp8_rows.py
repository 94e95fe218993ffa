"""The "fp8_blockwise" recipe across the expert axis: token rows cross in FP8 with their scales.

A row's 1x128 tiles along H depend on that row alone, so each shard quantises the rows it sends (one pass that
gathers them from its tokens, as the single-device op gathers its rows) and the expert shards run the recipe's
forward from the rows as they arrive: the same values as quantising after the exchange, in about half the bytes
(e4m3 values and one float32 scale per 128 values, against x's bfloat16). The results come back in x's dtype.

Quantised rows carry no gradient (theirs would be e4m3), so the rows' gradient returns through a channel of its
own: `rows.gradient_channel(x)` is zeros shaped as the sent rows, whose VJP is `dispatch_rows`' (the per-token sum
of `combine_rows`), and the channel crosses by the same exchange. The local step (`_local_step`, a custom VJP over the
recipe's forward and backward in `jax_megamoe.ops.fp8_gemms`) ignores the channel's value and returns the rows'
gradient as its cotangent, so autodiff brings it home by the reverse exchange in x's dtype. Nothing reads the
zeros: JAX drops their exchange from a gradient's program and XLA from a forward-only one (dead code), so the
forward moves no bf16 rows. No collective sits inside a custom VJP, so the step runs under `jax.shard_map` and
under `jax.vmap` with an axis name (emulated shards).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_megamoe import _ffi
from jax_megamoe.ops import fp8, fp8_gemms
from jax_megamoe.parallel.plan import Plan
from jax_megamoe.parallel.rows import gradient_channel


def expert_rows(
    transport,
    x: jax.Array,
    plan: Plan,
    recv_counts: jax.Array,
    recv_weights: jax.Array,
    recv_ids: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    axis_name: str,
    implementation: str,
) -> jax.Array:
    """One shard's expert step with the recipe, from its tokens `x [T, H]` to the returned rows `[ep, C, H]` (x's
    dtype; `combine_rows` sums them per token): the rows of `plan.token [ep, C]` go out quantised through
    `transport.exchange`, the local experts run on what arrives (`recv_counts` rows a block; `recv_weights`,
    `recv_ids [ep, C, R]`, already exchanged), the results come back."""
    token, slot, send_counts = plan.token, plan.slot, plan.row_counts
    ep, capacity = token.shape
    hidden = x.shape[1]

    def there(a):  # [ep * C, F] -> [ep, C, F] through the exchange
        return transport.exchange(a.reshape(ep, capacity, -1), send_counts, recv_counts, axis_name)

    values, scales = fp8_gemms.quantised_rows(jax.lax.stop_gradient(x), token.reshape(-1), implementation)
    # The padding columns past H are zeros on both sides: only H bytes a row cross, as bytes (any transport moves
    # them, and the nvlink workspace is sized for rows of x).
    recv_values = there(jax.lax.bitcast_convert_type(values[:, :hidden], jnp.uint8))
    recv_scales = there(scales)
    channel = transport.exchange(gradient_channel(x, token, slot), send_counts, recv_counts, axis_name)
    # Alike outside the custom VJP, so that autodiff sums the cotangents of operands replicated over other mesh axes.
    operands = _ffi.vary_alike(recv_values, recv_scales, channel, recv_weights, recv_ids, w_gate_up, w_down)
    y_rows = _local_step(*operands, implementation)
    return transport.exchange(y_rows, recv_counts, send_counts, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _local_step(recv_values, recv_scales, channel, recv_weights, recv_ids, w_gate_up, w_down, implementation):
    """The recipe on the received quantised rows: `[ep, C, H]` results in the channel's dtype (x's)."""
    return _local_step_fwd(
        recv_values, recv_scales, channel, recv_weights, recv_ids, w_gate_up, w_down, implementation
    )[0]


def _local_step_fwd(recv_values, recv_scales, channel, recv_weights, recv_ids, w_gate_up, w_down, implementation):
    ep, capacity, hidden = channel.shape
    rows = ep * capacity
    padded_hidden = recv_scales.shape[-1] * fp8.BLOCK
    values = jnp.pad(recv_values.reshape(rows, hidden), ((0, 0), (0, padded_hidden - hidden)))

    def x_rows(index):  # the bytes gathered as bytes, then read as e4m3
        picked, scales = fp8.take_rows(values, recv_scales.reshape(rows, -1), index)
        return jax.lax.bitcast_convert_type(picked, fp8.FP8_DTYPE), scales

    y_rows, residuals = fp8_gemms.forward(
        x_rows,
        hidden,
        channel.dtype,
        recv_weights.reshape(rows, -1),
        recv_ids.reshape(rows, -1),
        w_gate_up,
        w_down,
        implementation,
    )
    return y_rows.reshape(channel.shape), residuals


def _local_step_bwd(implementation, residuals, d_y_rows):
    ep, capacity, hidden = d_y_rows.shape
    d_rows, d_weights, _, d_w_gate_up, d_w_down = fp8_gemms.backward(
        implementation, residuals, d_y_rows.reshape(ep * capacity, hidden)
    )
    d_channel = d_rows.reshape(d_y_rows.shape)
    return None, None, d_channel, d_weights.reshape(ep, capacity, -1), None, d_w_gate_up, d_w_down


_local_step.defvjp(_local_step_fwd, _local_step_bwd)
