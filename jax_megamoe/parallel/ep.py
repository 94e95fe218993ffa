"""`moe_ffn_ep`: the MoE expert FFN with experts sharded over a mesh axis, for use inside `jax.shard_map`.

Per shard: plan where each token goes (`plan.py`), then the transport's expert step (`transport.py`): the
token rows go to their expert shards, `moe_ffn` runs on the received rows with this shard's experts (the
routing weights travel with the rows, so each row comes back already summed over its pairs), the results come
back and each token's returned rows are summed in shard order. Every step is linear in the floating-point data
or is `moe_ffn`, so JAX's transposes give the exact gradient; expert-weight gradients are computed where the
weights live. With one shard nothing moves and `moe_ffn` runs on the tokens directly.
"""

from __future__ import annotations

import numbers
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_megamoe.ops import fp8
from jax_megamoe.ops.layout import drop_invalid_ids
from jax_megamoe.ops.moe import moe_ffn, resolve_implementation
from jax_megamoe.ops.validation import check_moe_args, check_rank
from jax_megamoe.parallel.plan import INVALID_EXPERT, capacities, make_plan
from jax_megamoe.parallel.transport import XLA, Transport, all_to_all_blocks, resolve_transport

_warned: set[str] = set()  # fallback reasons already warned about, once per process


class EPStats(NamedTuple):
    """Routing statistics of one shard, from the receiving side (int32).

    expert_counts: `[E_local]` pairs computed by each of this shard's experts (from all sources).
    pairs_received: pairs computed on this shard (`expert_counts.sum()`).
    pairs_dropped: pairs routed to this shard's experts that exceeded the capacity (zero when dropless).
    Sum `pairs_dropped` over the mesh (`jax.lax.psum`) for the global count.
    """

    expert_counts: jax.Array
    pairs_received: jax.Array
    pairs_dropped: jax.Array


def _axis_size(axis_name) -> int:
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a mesh axis name (str), got {axis_name!r}")
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"axis_name {axis_name!r} is not bound: call moe_ffn_ep inside jax.shard_map over a "
            f"mesh that has an axis named {axis_name!r}"
        ) from None


def _check_capacity_factor(capacity_factor) -> None:
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
        raise TypeError(f"capacity_factor must be None or a positive number, got {capacity_factor!r}")
    if not float(capacity_factor) > 0 or capacity_factor == float("inf"):
        raise ValueError(f"capacity_factor must be a finite number > 0 (or None for dropless), got {capacity_factor}")


def _check_num_experts(num_experts, ep: int, local_experts: int) -> None:
    if num_experts is None:
        return
    if isinstance(num_experts, bool) or not isinstance(num_experts, numbers.Integral):
        raise TypeError(f"num_experts must be None or an int (the global expert count), got {num_experts!r}")
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-axis size {ep}")
    if local_experts != num_experts // ep:
        raise ValueError(
            f"w_gate_up_local and w_down_local must hold this shard's experts: leading dimension "
            f"num_experts / axis size = {num_experts} / {ep} = {num_experts // ep}, got {local_experts} "
            f"(shard the expert weights over the axis: in_specs P(axis_name) for them)"
        )


def _usable(
    transport: Transport, implementation: str, dtype, hidden: int, intermediate: int, recipe: str | None
) -> Transport:
    """`transport`, or "xla" with a warning (once per reason) where it cannot run this problem."""
    reason = transport.unsupported(implementation, dtype, hidden, intermediate, recipe)
    if reason is None:
        return transport
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"moe_ffn_ep: the {transport.name} transport cannot run this call ({reason}); using transport='xla'",
            UserWarning,
            stacklevel=3,
        )
    return XLA


def moe_ffn_ep(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate_up_local: jax.Array,
    w_down_local: jax.Array,
    *,
    axis_name: str = "expert",
    transport: str | Transport = "xla",
    implementation: str = "auto",
    capacity_factor: float | None = None,
    return_stats: bool = False,
    num_experts: int | None = None,
    recipe: str | None = None,
):
    """Expert-parallel `moe_ffn`; call inside `jax.shard_map` with the experts sharded over `axis_name`.

    Shard r of `axis_name` (of size ep) owns global experts `[r * E_local, (r + 1) * E_local)`, with
    `E = E_local * ep`. Each shard passes the tokens it holds (any sharding of the tokens over any mesh
    axes) and its slice of the expert weights. The result equals `moe_ffn` on the gathered problem to
    rounding, is bitwise reproducible run to run, and is differentiable in `x`, `weights`,
    `w_gate_up_local` and `w_down_local` (the weight gradients stay on their shard).

    Args:
      x: `[T, H]` this shard's tokens.
      weights: `[T, K]` routing weights.
      experts: `[T, K]` integer GLOBAL expert ids; pairs with ids outside `[0, E)` contribute zero.
      w_gate_up_local: `[E_local, H, 2I]` this shard's experts, same dtype as `x`.
      w_down_local: `[E_local, I, H]`, same dtype as `x`.
      axis_name: the mesh axis the experts are sharded over.
      transport: `"xla"` (`jax.lax.all_to_all`, fixed per-peer capacity, any platform), `"ragged"`
        (`jax.lax.ragged_all_to_all`: moves only the live rows; GPUs of one process), or
        `jax_megamoe.NvlinkTransport(workspace)` (the rows by the copy engines into the peers' memory, fused with
        the expert kernels; GPUs of one host). Where the nvlink transport cannot run the call (`implementation`
        not "cuda"; without a recipe also float32, H or I not a multiple of 8), "xla" runs instead, with a
        warning naming why.
      implementation: `moe_ffn`'s implementation for the local expert compute (`"auto"`, `"cuda"`, `"cpu"`,
        `"reference"`).
      capacity_factor: None for dropless. Otherwise each shard accepts at most
        `ceil(capacity_factor * T * K / ep)` pairs from each source shard, in (token, k) order; the
        pairs beyond contribute zero (and get zero gradient) and are counted in the stats.
      return_stats: also return an `EPStats` for this shard.
      recipe: `moe_ffn`'s recipe (None or "fp8_blockwise"). With "fp8_blockwise" on the kernels ("cuda", "cpu")
        the rows travel quantised (e4m3 values with their 1x128 tiles' scales: a row's tiles depend on that row
        alone, so the values are those of quantising after the exchange) over any transport, the nvlink transport
        by its plain exchange, and the results come back in x's dtype; on "reference" they travel in x's dtype.
      num_experts: the global expert count E, if known: checks it divides by ep and that the local
        weights hold E / ep experts (catches unsharded weights).

    Returns `y [T, H]` in x's dtype, or `(y, EPStats)` with `return_stats=True`.
    """
    _check_capacity_factor(capacity_factor)
    ep = _axis_size(axis_name)
    transport = resolve_transport(transport)
    transport.check(ep)
    check_rank("w_gate_up_local", w_gate_up_local, 3, "[E_local, H, 2I]")
    local_experts = w_gate_up_local.shape[0]
    _check_num_experts(num_experts, ep, local_experts)
    fp8.check_recipe(recipe)
    args = (x, weights, experts, w_gate_up_local, w_down_local)
    if recipe is None:
        tokens, hidden, inter, local_experts, top_k = check_moe_args(*args, num_experts=local_experts * ep)
        implementation = resolve_implementation(implementation, args)
    else:  # the recipe takes float32 master weights, and its CUDA kernels need FP8 tensor cores
        implementation = resolve_implementation(implementation, args)
        tokens, hidden, inter, local_experts, top_k = fp8.check_fp8_args(
            *args, implementation, num_experts=local_experts * ep
        )
    experts = drop_invalid_ids(experts, local_experts * ep)

    pair_capacity, row_capacity = capacities(tokens, top_k, ep, capacity_factor)
    if ep > 1:
        transport = _usable(transport, implementation, x.dtype, hidden, inter, recipe)
    plan = make_plan(
        experts,
        ep,
        local_experts,
        pair_capacity,
        row_capacity,
        compact=ep == 1 or transport.compact_rows(tokens, row_capacity, recipe),
    )
    if ep == 1:  # nothing moves: moe_ffn itself, bit for bit, minus the pairs over capacity
        kept_ids = experts if capacity_factor is None else jnp.where(plan.pair_mask[..., 0], experts, INVALID_EXPERT)
        y = moe_ffn(x, weights, kept_ids, w_gate_up_local, w_down_local, implementation=implementation, recipe=recipe)
    else:
        y = transport.experts(
            x,
            weights,
            plan,
            w_gate_up_local,
            w_down_local,
            axis_name=axis_name,
            implementation=implementation,
            recipe=recipe,
        )
    if not return_stats:
        return y
    counts = jnp.stack([plan.kept_counts, plan.dropped_counts], axis=1)  # [ep, 2, E_local]
    counts = jnp.sum(all_to_all_blocks(counts, axis_name), axis=0) if ep > 1 else counts[0]
    return y, EPStats(expert_counts=counts[0], pairs_received=jnp.sum(counts[0]), pairs_dropped=jnp.sum(counts[1]))
