"""The nvlink transport's plain exchange: `[ep, C, ...]` blocks by direct stores into the peers' staging blocks.

The fused calls (`fused.py`) move the token rows themselves; this exchange moves what they need to know first:
the received rows' local expert ids and routing weights (and, in the backward, the weights' cotangent). It has
the semantics of `transport.ragged_blocks`: only the live rows cross NVLink, with no NCCL call and no host
synchronisation.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi, _targets
from jax_megamoe.parallel.nvlink.workspace import NvlinkWorkspace


def _fill_byte(dtype, fill_value) -> int:
    """The byte whose repetition spells `fill_value` in `dtype` (0, or -1 for integers)."""
    if fill_value == 0:
        return 0
    if fill_value == -1 and jnp.issubdtype(dtype, jnp.signedinteger):
        return 0xFF
    raise ValueError(f"the nvlink transport fills with 0 (or -1 for integers), got {fill_value!r} for {dtype}")


def exchange(
    buffer: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, workspace: NvlinkWorkspace, fill_value=0
) -> jax.Array:
    """`transport.ragged_blocks` through the workspace: the first `send_counts[d]` rows of block d go to
    shard d; in the result, rows of block s past `recv_counts[s]` hold `fill_value`. Linear; its
    transpose is the reverse exchange."""
    row_bytes = math.prod(buffer.shape[2:]) * buffer.dtype.itemsize
    workspace.check_fits(buffer.shape[1], row_bytes)
    return _exchange(
        buffer,
        send_counts.astype(jnp.int32),
        recv_counts.astype(jnp.int32),
        workspace.id,
        _fill_byte(buffer.dtype, fill_value),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _exchange(buffer, send_counts, recv_counts, workspace_id: int, fill_byte: int):
    (out,) = _ffi.call(
        _targets.NVLINK_EXCHANGE,
        (jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),),
        buffer,
        send_counts,
        recv_counts,
        workspace=np.int64(workspace_id),
        fill_byte=np.int64(fill_byte),
    )
    return out


def _exchange_fwd(buffer, send_counts, recv_counts, workspace_id, fill_byte):
    return _exchange(buffer, send_counts, recv_counts, workspace_id, fill_byte), (send_counts, recv_counts)


def _exchange_bwd(workspace_id, fill_byte, residuals, d_out):
    send_counts, recv_counts = residuals
    if d_out.dtype == jax.dtypes.float0:  # integer payload (expert ids): no cotangent
        return None, None, None
    # Rows past the counts were filled, not sent: their cotangent is zero, which the fill of 0 gives.
    return _exchange(d_out, recv_counts, send_counts, workspace_id, 0), None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)
