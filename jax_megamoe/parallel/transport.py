"""Exchanging per-destination buffers `[ep, C, ...]` across the expert axis.

Every transport moves the same buffer layout: slot block d of the sender lands in block `sender` of
shard d. `"xla"` moves whole blocks (`all_to_all`, fixed capacity); `"ragged"` moves only the first
`send_counts[d]` rows of each block (`ragged_all_to_all`, GPU only); `"nvlink"` moves the same rows as
`"ragged"` by direct stores into the peers' memory (`nvlink.py`, GPU only, needs a workspace). All are
linear and transposed exactly by the reverse exchange.
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jax_megamoe.parallel import nvlink

TRANSPORTS = ("xla", "ragged", "nvlink")


def all_to_all_blocks(buffer: jax.Array, axis_name: str) -> jax.Array:
    """`out[s] = buffer[me]` of shard s: block d goes to shard d, blocks arrive in sender order."""
    return jax.lax.all_to_all(buffer, axis_name, split_axis=0, concat_axis=0, tiled=True)


def ragged_blocks(buffer: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, axis_name: str,
                  fill_value) -> jax.Array:
    """As `all_to_all_blocks`, moving only the first `send_counts[d]` rows of block d.

    Rows past `recv_counts[s]` in block s of the result hold `fill_value`.
    """
    ep, capacity = buffer.shape[:2]
    flat = buffer.reshape((ep * capacity,) + buffer.shape[2:])
    blocks = jnp.arange(ep, dtype=jnp.int32) * capacity
    me = jax.lax.axis_index(axis_name).astype(jnp.int32)
    received = jax.lax.ragged_all_to_all(
        flat, jnp.full_like(flat, fill_value), blocks, send_counts.astype(jnp.int32),
        jnp.full((ep,), me * capacity, jnp.int32), recv_counts.astype(jnp.int32), axis_name=axis_name)
    return received.reshape(buffer.shape)


def exchange(buffer: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, axis_name: str,
             transport: str, fill_value=0, workspace=None) -> jax.Array:
    """Sends block d of `buffer [ep, C, ...]` (its first `send_counts[d]` rows are live) to shard d.

    `workspace` is the `nvlink.NvlinkWorkspace` of the `"nvlink"` transport (unused by the others).
    """
    if transport == "nvlink":
        return nvlink.exchange(buffer, send_counts, recv_counts, workspace, fill_value)
    if transport == "ragged":
        return ragged_blocks(buffer, send_counts, recv_counts, axis_name, fill_value)
    return all_to_all_blocks(buffer, axis_name)


@functools.cache
def ragged_supported() -> bool:
    """Whether `ragged_all_to_all` works here (probed once per process).

    XLA implements it on GPUs only (XLA:CPU rejects it at compile time), and within one process: across
    `jax.distributed` processes XLA 0.11 refuses it ("RaggedAllToAll fallback to NCCL is not allowed",
    seen on two H200s, one process each).
    """
    return jax.default_backend() == "gpu" and jax.process_count() == 1 and probe_ragged()


def probe_ragged() -> bool:
    """Compiles and runs a one-device `ragged_blocks`; False on any failure. Safe to call while tracing."""
    # A fresh thread starts outside the caller's trace and mesh context (both are thread-local).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_run_ragged_probe).result()


def _run_ragged_probe() -> bool:
    mesh = jax.sharding.Mesh(jax.local_devices()[:1], ("probe",))  # addressable in every process
    spec = PartitionSpec("probe")

    def probe(x):
        return ragged_blocks(x, jnp.ones((1,), jnp.int32), jnp.ones((1,), jnp.int32), "probe", 0)

    try:
        x = jnp.arange(4, dtype=jnp.float32).reshape(1, 2, 2)
        out = jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=spec, out_specs=spec))(x)
        return bool(jnp.array_equal(out, jnp.array([[[0.0, 1.0], [0.0, 0.0]]])))
    except Exception:  # any failure means "not usable here": the caller falls back to all_to_all
        return False
