"""The KV cache of a decoder: every layer's keys and values, preallocated, with each row's written length."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Keys and values of every layer, `k, v [layers, B, S, kv_heads, head_dim]`, slot j of row b holding the
    token at position j, and `lengths [B]` (int32), the slots written per row: the next token of row b goes to
    slot (and position) `lengths[b]`. With `routing [layers, B, S, K]` (a cache made with `routing_top_k`), the
    experts each MoE layer chose for the token at each slot are recorded alongside (-1 where none was recorded).

    A pytree: it is carried through the decode loop and the scan over layers, written in place. Slots at and
    past a row's length may hold anything (a right-padded prompt's padding): attention never shows a query the
    slots beyond its own position, and each slot is written before a query reaches it.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    routing: jax.Array | None = None

    @classmethod
    def empty(
        cls,
        *,
        layers: int,
        batch: int,
        length: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        routing_top_k: int | None = None,
        routing_dtype=jnp.int32,
    ) -> KVCache:
        """A cache of `length` slots per row, zero-filled, nothing written; with `routing_top_k` a routing
        record of that many experts per token in `routing_dtype`, filled with -1."""
        shape = (layers, batch, length, kv_heads, head_dim)
        routing = None
        if routing_top_k is not None:
            routing = jnp.full((layers, batch, length, routing_top_k), -1, routing_dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32), routing)

    @property
    def nbytes(self) -> int:
        """Bytes of the keys, values and routing record (all devices together); also of an abstract cache
        (`jax.eval_shape`)."""
        routing = 0 if self.routing is None else math.prod(self.routing.shape) * self.routing.dtype.itemsize
        return 2 * math.prod(self.k.shape) * self.k.dtype.itemsize + routing

    def layer(self, index) -> tuple[jax.Array, jax.Array]:
        """Layer `index`'s keys and values `[B, S, kv_heads, head_dim]` (`index` an int or a traced scalar)."""
        return (
            jax.lax.dynamic_index_in_dim(self.k, index, keepdims=False),
            jax.lax.dynamic_index_in_dim(self.v, index, keepdims=False),
        )

    def _write_rows(self, stack: jax.Array, index, new: jax.Array) -> jax.Array:
        # One update per row, its start that row's length: vmapped, the rows are a batch dimension of the update,
        # which the SPMD partitioner keeps sharded with them.
        def one_row(row, values, start):
            starts = (index, start) + (0,) * (row.ndim - 2)
            return jax.lax.dynamic_update_slice(row, values[None], starts)

        return jax.vmap(one_row, in_axes=(1, 0, 0), out_axes=1)(stack, new.astype(stack.dtype), self.lengths)

    def write(self, index, k: jax.Array, v: jax.Array) -> KVCache:
        """The cache with `k, v [B, T, kv_heads, head_dim]` written into layer `index` at slots
        `lengths[b] .. lengths[b] + T - 1` of each row (the lengths unchanged: `advance` moves them once every
        layer is written)."""
        return self._replace(k=self._write_rows(self.k, index, k), v=self._write_rows(self.v, index, v))

    def record(self, index, experts: jax.Array) -> KVCache:
        """The cache with `experts [B, T, K]`, layer `index`'s routing of the tokens being written, recorded at
        their slots (as `write`); unchanged when the cache keeps no routing record."""
        if self.routing is None:
            return self
        return self._replace(routing=self._write_rows(self.routing, index, experts))

    def advance(self, tokens: int) -> KVCache:
        """The cache with every row's length moved past `tokens` more written slots."""
        return self._replace(lengths=self.lengths + tokens)
