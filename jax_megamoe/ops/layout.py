"""The expert-sorted row layout of the (token, k) pairs, shared by `moe_ffn`'s kernels and the FP8 recipe's: one
type, `Layout`, made by the layout kernel or its pure-JAX twin (`moe_layout`), or padded so that each expert's rows
start at a multiple of a tile (`padded_layout`, the FP8 kernels' order)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi, _targets


def drop_invalid_ids(experts: jax.Array, num_experts: int) -> jax.Array:
    """`experts` as int32 with every id outside `[0, num_experts)` replaced by -1, before the cast can wrap a
    wide id (an int64 2**32 + 1 would become 1) into range."""
    valid = (experts >= 0) & (experts < num_experts)
    return jnp.where(valid, experts, -1).astype(jnp.int32)


class Layout(NamedTuple):
    """The (token, k) pairs sorted by expert id, stable in pair order, in R rows: expert e's rows are
    `[expert_offsets[e], expert_offsets[e + 1])`. A dropped pair (id outside `[0, E)`) has no row and a row past
    the last expert's has no pair: each holds an index out of its array's range, -1 from `moe_layout`, R or T*K
    from `padded_layout` (what `jnp.take(mode="fill")` and `.at[...].set(mode="drop")` skip)."""

    row_of_pair: jax.Array  # [T*K] int32: the pair's row
    pair_of_row: jax.Array  # [R] int32: the row's pair (t * K + k)
    expert_offsets: jax.Array  # [E+1] int32


def moe_layout(experts: jax.Array, num_experts: int, implementation: str) -> Layout:
    """Sorts the (token, k) pairs by expert id, stable in pair order, in R = T*K rows, by the layout kernel of
    `implementation` ("cpu", "cuda") or in pure JAX ("reference"). `experts` are int32; ids outside
    `[0, num_experts)` are dropped."""
    if implementation == "reference":
        return _sorted_in_jax(experts, num_experts)
    num_pairs = experts.size
    shapes = (
        jax.ShapeDtypeStruct((num_pairs,), jnp.int32),
        jax.ShapeDtypeStruct((num_pairs,), jnp.int32),
        jax.ShapeDtypeStruct((num_experts + 1,), jnp.int32),
    )
    return Layout(
        *_ffi.call(
            _targets.MOE_LAYOUT[implementation],
            shapes,
            experts,
            workspace_args=(num_pairs, num_experts),
            num_experts=np.int64(num_experts),
        )
    )


def _sorted_in_jax(experts: jax.Array, num_experts: int) -> Layout:
    ids = experts.reshape(-1)
    valid = (ids >= 0) & (ids < num_experts)
    key = jnp.where(valid, ids, num_experts).astype(jnp.int32)  # dropped pairs sort last
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts]
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    rows = jnp.arange(ids.size, dtype=jnp.int32)
    row_of_pair = jnp.zeros(ids.size, jnp.int32).at[order].set(rows)
    return Layout(
        jnp.where(valid, row_of_pair, -1), jnp.where(rows < offsets[-1], order, -1).astype(jnp.int32), offsets
    )


def padded_rows(pairs: int, num_experts: int, multiple: int) -> int:
    """The rows of `padded_layout`: room for every expert's rows rounded up to a multiple of `multiple`."""
    rows = pairs + (multiple - 1) * min(num_experts, pairs)
    return -(-rows // multiple) * multiple


def padded_layout(experts: jax.Array, num_experts: int, implementation: str, multiple: int) -> Layout:
    """`moe_layout` in `padded_rows` rows, each expert's first row at a multiple of `multiple`: the rows between
    two experts' and past the last one's have no pair. `experts` int32 with the dropped ids at -1
    (`drop_invalid_ids`)."""
    pairs = experts.size
    capacity = padded_rows(pairs, num_experts, multiple)
    layout = moe_layout(experts, num_experts, implementation)
    counts = jnp.diff(layout.expert_offsets)
    offsets = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum(-(-counts // multiple) * multiple).astype(jnp.int32)]
    )
    shift = offsets[:-1] - layout.expert_offsets[:-1]
    ids = experts.reshape(-1)
    row_of_pair = jnp.where(layout.row_of_pair >= 0, layout.row_of_pair + shift[jnp.maximum(ids, 0)], capacity)
    pair_of_row = (
        jnp.full(capacity, pairs, jnp.int32).at[row_of_pair].set(jnp.arange(pairs, dtype=jnp.int32), mode="drop")
    )
    return Layout(row_of_pair.astype(jnp.int32), pair_of_row, offsets)
