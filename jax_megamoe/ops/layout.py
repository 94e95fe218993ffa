"""The expert-sorted row layout of the (token, k) pairs, shared by `moe_ffn`'s kernels and the FP8 recipe's."""

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
    """Expert-sorted order of the (token, k) pairs; see `moe_layout`."""

    row_of_pair: jax.Array  # [T*K] int32, -1 for dropped pairs
    pair_of_row: jax.Array  # [T*K] int32, -1 past the last valid row
    expert_offsets: jax.Array  # [E+1] int32


def moe_layout(experts: jax.Array, num_experts: int, implementation: str) -> Layout:
    """Sorts the (token, k) pairs by expert id, stable in pair order, on `implementation` ("cpu"/"cuda").
    `experts` are int32; ids outside `[0, num_experts)` are dropped."""
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
