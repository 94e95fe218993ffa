"""`moe_ffn_ep`: the MoE expert FFN with experts sharded over a mesh axis, for use inside `jax.shard_map`.

Per shard: plan where each token goes (`plan.py`), gather token rows into per-destination slots
(`rows.py`), exchange them over the expert axis (`transport.py`), run `moe_ffn` on the received rows
with this shard's experts (the routing weights travel with the rows, so each row comes back already
summed over its pairs), exchange the results back, and sum each token's returned rows in shard order.
Every step is linear in the floating-point data or is `moe_ffn`, so JAX's transposes give the exact
gradient; expert-weight gradients are computed where the weights live. With one shard nothing moves
and `moe_ffn` runs on the tokens directly. On the nvlink transport, where it applies
(`nvlink_experts.overlap_applies`), the rows' exchange, `moe_ffn`'s forward and the results' return are one call
that runs the rows' exchange beside the GEMM of the shard's own rows, and the backward's two exchanges and
`moe_ffn`'s backward are one call that sends the rows' cotangent back beside the last GEMM (stage 2), with the same
results bit for bit. Those calls move whole blocks, so when every token has a slot they take x itself as every
destination's block (an uncompacted plan) instead of building send blocks.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_megamoe.ops.moe import moe_ffn, resolve_backend
from jax_megamoe.ops.validation import check_moe_args, check_rank
from jax_megamoe.parallel import nvlink, nvlink_experts, transport
from jax_megamoe.parallel.plan import INVALID_EXPERT, capacities, make_plan, row_routing
from jax_megamoe.parallel.rows import combine_rows, dispatch_rows

BACKENDS = ("auto",) + transport.TRANSPORTS


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
        raise ValueError(f"axis_name {axis_name!r} is not bound: call moe_ffn_ep inside jax.shard_map over a "
                         f"mesh that has an axis named {axis_name!r}") from None


def _check_capacity_factor(capacity_factor) -> None:
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
        raise TypeError(f"capacity_factor must be None or a positive number, got {capacity_factor!r}")
    if not capacity_factor > 0 or capacity_factor == float("inf"):
        raise ValueError(f"capacity_factor must be a finite number > 0 (or None for dropless), got {capacity_factor}")


def _resolve_transport(backend: str, workspace, ep: int) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nvlink":
        if not isinstance(workspace, nvlink.NvlinkWorkspace):
            raise ValueError(f"backend='nvlink' needs workspace=NvlinkWorkspace(mesh, axis_name, ...) created "
                             f"once outside jit, got workspace={workspace!r}")
        if workspace.ranks != ep:
            raise ValueError(f"the nvlink workspace spans {workspace.ranks} shards, the expert axis has {ep}")
        return backend
    if workspace is not None:
        raise ValueError(f"workspace is only used by backend='nvlink', got backend={backend!r}")
    if backend == "auto":  # on two H200s "ragged" measured 15-20x slower than "xla" (benchmarks/RESULTS.md)
        return "xla"
    if backend == "ragged" and not transport.ragged_supported():
        raise ValueError(f"backend='ragged' needs jax.lax.ragged_all_to_all, which XLA implements on GPUs only and "
                         f"within one process (default backend here: {jax.default_backend()!r}, "
                         f"{jax.process_count()} process(es)); use backend='xla'")
    return backend


def _check_num_experts(num_experts, ep: int, local_experts: int) -> None:
    if num_experts is None:
        return
    if isinstance(num_experts, bool) or not isinstance(num_experts, numbers.Integral):
        raise TypeError(f"num_experts must be None or an int (the global expert count), got {num_experts!r}")
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-axis size {ep}")
    if local_experts != num_experts // ep:
        raise ValueError(f"w_gate_up_local and w_down_local must hold this shard's experts: leading dimension "
                         f"num_experts / axis size = {num_experts} / {ep} = {num_experts // ep}, got {local_experts} "
                         f"(shard the expert weights over the axis: in_specs P(axis_name) for them)")


def _gather_rows(per_dest: jax.Array, token: jax.Array, fill_value) -> jax.Array:
    """`out[d, c] = per_dest[token[d, c], d]` (`per_dest [T, ep, R]`), `fill_value` for empty slots."""
    dest = jnp.arange(token.shape[0], dtype=jnp.int32)[:, None]
    return per_dest.at[token, dest].get(mode="fill", fill_value=fill_value)


def moe_ffn_ep(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up_local: jax.Array,
               w_down_local: jax.Array, *, axis_name: str = "expert", backend: str = "auto",
               capacity_factor: float | None = None, return_stats: bool = False, num_experts: int | None = None,
               local_backend: str = "auto", workspace: nvlink.NvlinkWorkspace | None = None):
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
      backend: `"xla"` (`jax.lax.all_to_all`, fixed per-peer capacity, any platform), `"ragged"`
        (`jax.lax.ragged_all_to_all`: moves only the live rows; GPUs of one process), `"nvlink"` (the live rows by
        direct stores into the peers' memory; GPUs of one process, needs `workspace`) or `"auto"`
        (xla: the fastest measured without a workspace).
      capacity_factor: None for dropless. Otherwise each shard accepts at most
        `ceil(capacity_factor * T * K / ep)` pairs from each source shard, in (token, k) order; the
        pairs beyond contribute zero (and get zero gradient) and are counted in the stats.
      return_stats: also return an `EPStats` for this shard.
      num_experts: the global expert count E, if known: checks it divides by ep and that the local
        weights hold E / ep experts (catches unsharded weights).
      local_backend: `moe_ffn`'s backend for the local expert compute (`"auto"`, `"cuda"`, `"cpu"`,
        `"reference"`).
      workspace: the `NvlinkWorkspace` of `backend="nvlink"`, created once for the mesh axis (or
        `NvlinkWorkspace.emulated(R, ...)` with this function under `jax.vmap(axis_name=...)` over R).

    Returns `y [T, H]` in x's dtype, or `(y, EPStats)` with `return_stats=True`.
    """
    _check_capacity_factor(capacity_factor)
    ep = _axis_size(axis_name)
    transport_name = _resolve_transport(backend, workspace, ep)
    check_rank("w_gate_up_local", w_gate_up_local, 3, "[E_local, H, 2I]")
    local_experts = w_gate_up_local.shape[0]
    _check_num_experts(num_experts, ep, local_experts)
    tokens, _, _, local_experts, top_k = check_moe_args(
        x, weights, experts, w_gate_up_local, w_down_local, num_experts=local_experts * ep)

    pair_capacity, row_capacity = capacities(tokens, top_k, ep, capacity_factor)
    hidden, inter = x.shape[1], w_down_local.shape[1]
    overlapped = ep > 1 and transport_name == "nvlink" and nvlink_experts.overlap_applies(
        workspace, resolve_backend(local_backend), x.dtype, hidden, inter)
    # The overlapped calls push whole blocks, so compacting the rows buys nothing once every token has a slot
    # (C = T): then each block is x itself and no send blocks are built.
    x_as_blocks = overlapped and row_capacity == tokens
    plan = make_plan(experts, ep, local_experts, pair_capacity, row_capacity, compact=not x_as_blocks)
    if ep == 1:  # nothing moves: moe_ffn itself, bit for bit, minus the pairs over capacity
        kept_ids = experts if capacity_factor is None else jnp.where(plan.pair_mask[..., 0], experts, INVALID_EXPERT)
        y = moe_ffn(x, weights, kept_ids, w_gate_up_local, w_down_local, backend=local_backend)
    else:
        y = _exchange_and_compute(x, weights, plan, w_gate_up_local, w_down_local, axis_name, transport_name,
                                  local_backend, workspace, overlapped, x_as_blocks)
    if not return_stats:
        return y
    counts = jnp.stack([plan.kept_counts, plan.dropped_counts], axis=1)              # [ep, 2, E_local]
    counts = jnp.sum(transport.all_to_all_blocks(counts, axis_name), axis=0) if ep > 1 else counts[0]
    return y, EPStats(expert_counts=counts[0], pairs_received=jnp.sum(counts[0]), pairs_dropped=jnp.sum(counts[1]))


def _exchange_and_compute(x, weights, plan, w_gate_up_local, w_down_local, axis_name, transport_name,
                          local_backend, workspace, overlapped, x_as_blocks):
    """Rows out to their expert shards, the local experts on what arrives, results back, summed per token.

    With stage 2's overlapped calls (nvlink, `nvlink_experts.overlap_applies`) the ids and weights go first and
    one call moves the rows, runs the local experts and brings the results back (in the backward, one call moves
    the results' cotangent, runs the experts' backward and sends the rows' cotangent back); with `x_as_blocks`
    (an uncompacted plan) x itself is every destination's block, and the call sums the results too.
    """
    ep, row_capacity = plan.token.shape
    local_experts = w_gate_up_local.shape[0]
    row_ids, row_weights = row_routing(plan, weights, local_experts)
    if x_as_blocks:  # rows sit at their token's index: the exchanges move whole blocks
        send_counts = recv_counts = jnp.full((ep,), row_capacity, jnp.int32)
    else:
        send_counts, recv_counts = plan.row_counts, transport.all_to_all_blocks(plan.row_counts, axis_name)

    def there(buffer, fill_value=0):
        return transport.exchange(buffer, send_counts, recv_counts, axis_name, transport_name, fill_value,
                                  workspace)

    def back(buffer):
        return transport.exchange(buffer, recv_counts, send_counts, axis_name, transport_name,
                                  workspace=workspace)

    send = None if x_as_blocks else dispatch_rows(x, plan.token, plan.slot)
    recv_x = None if overlapped else there(send)  # stage 1: the rows go first, as they always have
    recv_ids = there(_gather_rows(row_ids, plan.token, INVALID_EXPERT), INVALID_EXPERT)
    recv_weights = there(_gather_rows(row_weights, plan.token, 0))
    if x_as_blocks:
        return nvlink_experts.overlapped_experts_on_tokens(x, recv_ids, recv_weights, w_gate_up_local, w_down_local,
                                                           workspace)
    if overlapped:
        returned = nvlink_experts.overlapped_experts(send, recv_ids, recv_weights, w_gate_up_local, w_down_local,
                                                     workspace)
    else:
        rows = ep * row_capacity
        recv_y = moe_ffn(recv_x.reshape(rows, -1), recv_weights.reshape(rows, -1), recv_ids.reshape(rows, -1),
                         w_gate_up_local, w_down_local, backend=local_backend).reshape(ep, row_capacity, -1)
        returned = back(recv_y)
    return combine_rows(returned, plan.slot, plan.token)
