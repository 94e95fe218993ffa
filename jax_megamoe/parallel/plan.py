"""Dispatch plan for expert parallelism: which token rows go to which shard, in which slot.

Integer bookkeeping only (no gradients). A token routed to several experts of one shard is sent to
that shard once (one row), carrying all of its pairs for that shard; the receiving shard runs the
local expert FFN on the row with those pairs' local expert ids and routing weights.

Capacity is counted in (token, k) pairs per (source shard, destination shard): each destination
accepts at most `pair_capacity` pairs from each source, in (token, k) order; later pairs are dropped
(contribute zero) and counted. Dropless means `pair_capacity = T * K`.

Rows are compacted by default: the rows sent to shard d fill the first slots of its buffer, so a transport can
move only those. A transport that moves whole buffers anyway (the nvlink transport's fused calls) asks for
uncompacted rows when every token fits (`C = T`): token t keeps slot t in every buffer, so each buffer is x itself.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

INVALID_EXPERT = -1  # local id of an empty slot; moe_ffn drops ids outside [0, E_local)


class Plan(NamedTuple):
    """Where each token goes. `ep` shards, `C` row slots per (source, destination) pair."""

    slot: jax.Array  # [T, ep] int32: slot of token t in the buffer to shard d, -1 if not sent
    token: jax.Array  # [ep, C] int32: token in slot c of the buffer to shard d, T if empty
    row_counts: jax.Array  # [ep] int32: rows sent to each shard
    pair_mask: jax.Array  # [T, K, ep] bool: pair (t, k) is sent to shard d
    local_ids: jax.Array  # [T, K] int32: expert id within its shard (garbage where not sent)
    kept_counts: jax.Array  # [ep, E_local] int32: pairs sent to each expert
    dropped_counts: jax.Array  # [ep, E_local] int32: pairs over capacity, per expert


def capacities(tokens: int, top_k: int, ep: int, capacity_factor: float | None) -> tuple[int, int]:
    """`(pair_capacity, row_capacity)` per (source, destination) shard pair.

    Dropless: every pair fits. Otherwise `ceil(capacity_factor * T * K / ep)` pairs, the balanced share.
    Rows never exceed tokens (one row per token and destination) nor accepted pairs.
    """
    pair_capacity = tokens * top_k
    if capacity_factor is not None:
        pair_capacity = min(pair_capacity, math.ceil(capacity_factor * tokens * top_k / ep))
    return pair_capacity, min(tokens, pair_capacity)


def make_plan(
    experts: jax.Array, ep: int, local_experts: int, pair_capacity: int, row_capacity: int, compact: bool = True
) -> Plan:
    """Builds the dispatch plan from GLOBAL expert ids `[T, K]`; ids outside `[0, ep*E_local)` are ignored.

    `compact=False` (needs `row_capacity == T`) gives token t slot t at every destination it is sent to."""
    tokens, top_k = experts.shape
    if not compact and row_capacity != tokens:
        raise ValueError(f"uncompacted rows need a slot per token: row_capacity {row_capacity} != tokens {tokens}")
    num_experts = ep * local_experts
    valid = (experts >= 0) & (experts < num_experts)  # before the cast, which could wrap a wide id into range
    experts = jnp.where(valid, experts, 0).astype(jnp.int32)
    dest = jnp.where(valid, experts // local_experts, ep)
    to_dest = dest[..., None] == jnp.arange(ep, dtype=jnp.int32)  # [T, K, ep]
    if pair_capacity >= tokens * top_k:
        kept = valid
    else:
        # Rank of each pair among the pairs to its destination, in (token, k) order.
        rank = jnp.cumsum(to_dest.reshape(tokens * top_k, ep).astype(jnp.int32), axis=0) - 1
        pair_rank = jnp.sum(jnp.where(to_dest, rank.reshape(tokens, top_k, ep), 0), axis=-1)
        kept = valid & (pair_rank < pair_capacity)
    pair_mask = to_dest & kept[..., None]

    row_sent = jnp.any(pair_mask, axis=1)  # [T, ep]
    if compact:
        rank = jnp.cumsum(row_sent.astype(jnp.int32), axis=0) - 1
    else:
        rank = jnp.arange(tokens, dtype=jnp.int32)[:, None]
    slot = jnp.where(row_sent, rank, -1)
    dest_index = jnp.broadcast_to(jnp.arange(ep, dtype=jnp.int32), (tokens, ep))
    token_index = jnp.broadcast_to(jnp.arange(tokens, dtype=jnp.int32)[:, None], (tokens, ep))
    # Unsent (slot -1 -> row_capacity) writes fall off the end; each (d, c) gets at most one token.
    token = (
        jnp.full((ep, row_capacity), tokens, jnp.int32)
        .at[dest_index, jnp.where(slot >= 0, slot, row_capacity)]
        .set(token_index, mode="drop", unique_indices=True)
    )

    flat = jnp.where(valid, experts, num_experts).reshape(-1)
    kept_counts = jnp.zeros(num_experts + 1, jnp.int32).at[jnp.where(kept.reshape(-1), flat, num_experts)].add(1)
    dropped = valid & ~kept
    dropped_counts = jnp.zeros(num_experts + 1, jnp.int32).at[jnp.where(dropped.reshape(-1), flat, num_experts)].add(1)
    return Plan(
        slot=slot.astype(jnp.int32),
        token=token,
        row_counts=jnp.sum(row_sent, axis=0, dtype=jnp.int32),
        pair_mask=pair_mask,
        local_ids=experts - dest * local_experts,
        kept_counts=kept_counts[:num_experts].reshape(ep, local_experts),
        dropped_counts=dropped_counts[:num_experts].reshape(ep, local_experts),
    )


def row_routing(plan: Plan, weights: jax.Array, local_experts: int) -> tuple[jax.Array, jax.Array]:
    """Per (token, destination) routing for the receiver: `(ids [T, ep, R] int32, weights [T, ep, R])`.

    With K <= E_local, column k holds pair k (or an invalid id). With K > E_local a row may carry more
    pairs than moe_ffn accepts columns (K <= E), so column j is local expert j with the summed weight
    of the row's pairs to it (repeated ids in a token's top-k are rare but legal).
    """
    top_k = weights.shape[1]
    mask = jnp.swapaxes(plan.pair_mask, 1, 2)  # [T, ep, K]
    if top_k <= local_experts:
        ids = jnp.where(mask, plan.local_ids[:, None, :], INVALID_EXPERT)
        return ids, jnp.where(mask, weights[:, None, :], 0)
    hit = mask[..., None] & (plan.local_ids[:, None, :, None] == jnp.arange(local_experts))  # [T, ep, K, E_local]
    row_weights = jnp.einsum("tdkj,tk->tdj", hit.astype(weights.dtype), weights)
    ids = jnp.where(jnp.any(hit, axis=2), jnp.arange(local_experts, dtype=jnp.int32), INVALID_EXPERT)
    return ids, row_weights
