"""The KV cache of a decoder: every layer's keys and values, preallocated, with each row's written length."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Keys and values of every layer, `k, v [layers, B, S, kv_heads, head_dim]`, slot j of row b holding the
    token at position j, and `lengths [B]` (int32), the slots written per row: the next token of row b goes to
    slot (and position) `lengths[b]`.

    A pytree: it is carried through the decode loop and the scan over layers, written in place. Slots at and
    past a row's length may hold anything (a right-padded prompt's padding): attention never shows a query the
    slots beyond its own position, and each slot is written before a query reaches it.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def empty(cls, *, layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
        """A cache of `length` slots per row, zero-filled, nothing written."""
        shape = (layers, batch, length, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values (all devices together); also of an abstract cache (`jax.eval_shape`)."""
        return 2 * math.prod(self.k.shape) * self.k.dtype.itemsize

    def layer(self, index) -> tuple[jax.Array, jax.Array]:
        """Layer `index`'s keys and values `[B, S, kv_heads, head_dim]` (`index` an int or a traced scalar)."""
        return (
            jax.lax.dynamic_index_in_dim(self.k, index, keepdims=False),
            jax.lax.dynamic_index_in_dim(self.v, index, keepdims=False),
        )

    def write(self, index, k: jax.Array, v: jax.Array) -> KVCache:
        """The cache with `k, v [B, T, kv_heads, head_dim]` written into layer `index` at slots
        `lengths[b] .. lengths[b] + T - 1` of each row (the lengths unchanged: `advance` moves them once every
        layer is written)."""

        def write_rows(cache, new):
            # One update per row, its start that row's length: vmapped, the rows are a batch dimension of the
            # update, which the SPMD partitioner keeps sharded with them.
            def one_row(row, values, start):
                return jax.lax.dynamic_update_slice(row, values[None], (index, start, 0, 0))

            return jax.vmap(one_row, in_axes=(1, 0, 0), out_axes=1)(cache, new.astype(cache.dtype), self.lengths)

        return self._replace(k=write_rows(self.k, k), v=write_rows(self.v, v))

    def advance(self, tokens: int) -> KVCache:
        """The cache with every row's length moved past `tokens` more written slots."""
        return self._replace(lengths=self.lengths + tokens)
