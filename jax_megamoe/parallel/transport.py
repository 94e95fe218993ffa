"""How `moe_ffn_ep` moves token rows across the expert axis: the `Transport` interface and the XLA transports.

A transport does two things: `exchange` sends block d of a `[ep, C, ...]` buffer to shard d (blocks arrive
in sender order), and `experts` runs the whole expert step of one shard (rows out to their experts, the local
experts on what arrives, results back, summed per token). The base class builds `experts` from `exchange` and
`moe_ffn`; a transport that fuses the exchange with the expert kernels overrides it (the nvlink transport,
`parallel/nvlink/`). `"xla"` moves whole blocks (`all_to_all`, fixed capacity, any platform); `"ragged"` moves
only the live rows (`ragged_all_to_all`, GPUs of one process). Every exchange is linear and transposed exactly
by the reverse exchange.
"""

from __future__ import annotations

import abc
import concurrent.futures
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jax_megamoe.ops.moe import moe_ffn
from jax_megamoe.parallel import fp8_rows
from jax_megamoe.parallel.plan import INVALID_EXPERT, Plan, row_routing
from jax_megamoe.parallel.rows import combine_rows, dispatch_rows

TRANSPORT_NAMES = ("xla", "ragged")


def all_to_all_blocks(buffer: jax.Array, axis_name: str) -> jax.Array:
    """`out[s] = buffer[me]` of shard s: block d goes to shard d, blocks arrive in sender order."""
    return jax.lax.all_to_all(buffer, axis_name, split_axis=0, concat_axis=0, tiled=True)


def ragged_blocks(
    buffer: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, axis_name: str, fill_value
) -> jax.Array:
    """As `all_to_all_blocks`, moving only the first `send_counts[d]` rows of block d.

    Rows past `recv_counts[s]` in block s of the result hold `fill_value`.
    """
    ep, capacity = buffer.shape[:2]
    flat = buffer.reshape((ep * capacity,) + buffer.shape[2:])
    blocks = jnp.arange(ep, dtype=jnp.int32) * capacity
    me = jax.lax.axis_index(axis_name).astype(jnp.int32)
    received = jax.lax.ragged_all_to_all(
        flat,
        jnp.full_like(flat, fill_value),
        blocks,
        send_counts.astype(jnp.int32),
        jnp.full((ep,), me * capacity, jnp.int32),
        recv_counts.astype(jnp.int32),
        axis_name=axis_name,
    )
    return received.reshape(buffer.shape)


def routing_blocks(plan: Plan, weights: jax.Array, local_experts: int) -> tuple[jax.Array, jax.Array]:
    """Per destination block, the rows' local expert ids `[ep, C, R]` (INVALID_EXPERT in empty slots) and
    routing weights `[ep, C, R]` (0 there), in the plan's slot order."""
    row_ids, row_weights = row_routing(plan, weights, local_experts)
    dest = jnp.arange(plan.token.shape[0], dtype=jnp.int32)[:, None]

    def gather(per_dest, fill_value):
        return per_dest.at[plan.token, dest].get(mode="fill", fill_value=fill_value)

    return gather(row_ids, INVALID_EXPERT), gather(row_weights, 0)


class Transport(abc.ABC):
    """How rows move between the shards of the expert axis (see the module docstring)."""

    name: str

    def check(self, ep: int) -> None:  # noqa: B027 - most transports run on any mesh
        """Raises ValueError if the transport cannot run over an expert axis of `ep` shards here."""

    def unsupported(
        self, implementation: str, dtype, hidden: int, intermediate: int, recipe: str | None = None
    ) -> str | None:
        """Why this transport cannot run the problem (then `moe_ffn_ep` falls back to "xla"), or None."""
        del implementation, dtype, hidden, intermediate, recipe
        return None

    def compact_rows(self, tokens: int, row_capacity: int, recipe: str | None = None) -> bool:
        """Whether the plan packs each destination's rows into the first slots of its block (`plan.make_plan`)."""
        del tokens, row_capacity, recipe
        return True

    @abc.abstractmethod
    def exchange(
        self, buffer: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, axis_name: str, fill_value=0
    ) -> jax.Array:
        """Sends block d of `buffer [ep, C, ...]` (its first `send_counts[d]` rows are live) to shard d; rows of
        received block s past `recv_counts[s]` hold `fill_value` (or whatever was sent, for whole-block
        transports)."""

    def experts(
        self,
        x: jax.Array,
        weights: jax.Array,
        plan: Plan,
        w_gate_up: jax.Array,
        w_down: jax.Array,
        *,
        axis_name: str,
        implementation: str,
        recipe: str | None = None,
    ) -> jax.Array:
        """One shard's expert step: its tokens' rows to their expert shards, the local experts on the rows that
        arrive, the results back and summed per token in destination order. Returns `[T, H]`. With the FP8 recipe
        on the kernels the rows travel quantised (`fp8_rows.py`); the reference quantises them after the exchange."""
        ep, row_capacity = plan.token.shape
        ids, row_weights = routing_blocks(plan, weights, w_gate_up.shape[0])
        send_counts, recv_counts = plan.row_counts, all_to_all_blocks(plan.row_counts, axis_name)

        def there(buffer, fill_value=0):
            return self.exchange(buffer, send_counts, recv_counts, axis_name, fill_value)

        recv_ids = there(ids, INVALID_EXPERT)
        recv_weights = there(row_weights)
        if recipe is not None and implementation != "reference":
            returned = fp8_rows.expert_rows(
                self,
                x,
                plan,
                recv_counts,
                recv_weights,
                recv_ids,
                w_gate_up,
                w_down,
                axis_name=axis_name,
                implementation=implementation,
            )
        else:
            recv_x = there(dispatch_rows(x, plan.token, plan.slot))
            rows = ep * row_capacity
            recv_y = moe_ffn(
                recv_x.reshape(rows, -1),
                recv_weights.reshape(rows, -1),
                recv_ids.reshape(rows, -1),
                w_gate_up,
                w_down,
                implementation=implementation,
                recipe=recipe,
            ).reshape(ep, row_capacity, -1)
            returned = self.exchange(recv_y, recv_counts, send_counts, axis_name)
        return combine_rows(returned, plan.slot, plan.token)


class XlaTransport(Transport):
    """`jax.lax.all_to_all` of whole blocks: any platform, any number of processes."""

    name = "xla"

    def exchange(self, buffer, send_counts, recv_counts, axis_name, fill_value=0):
        del send_counts, recv_counts, fill_value  # whole blocks move; the rows past the counts are zero
        return all_to_all_blocks(buffer, axis_name)


class RaggedTransport(Transport):
    """`jax.lax.ragged_all_to_all` of the live rows: GPUs of one process."""

    name = "ragged"

    def check(self, ep: int) -> None:
        if not ragged_supported():
            raise ValueError(
                f"transport='ragged' needs jax.lax.ragged_all_to_all, which XLA implements on GPUs "
                f"only and within one process (default backend here: {jax.default_backend()!r}, "
                f"{jax.process_count()} process(es)); use transport='xla'"
            )

    def exchange(self, buffer, send_counts, recv_counts, axis_name, fill_value=0):
        return ragged_blocks(buffer, send_counts, recv_counts, axis_name, fill_value)


XLA = XlaTransport()
RAGGED = RaggedTransport()


def resolve_transport(transport) -> Transport:
    """`"xla"`, `"ragged"` or a `Transport` object (e.g. `jax_megamoe.NvlinkTransport(workspace)`)."""
    if isinstance(transport, Transport):
        return transport
    if transport == "xla":
        return XLA
    if transport == "ragged":
        return RAGGED
    if transport == "nvlink":
        raise ValueError(
            "transport='nvlink' needs its workspace: create `ws = jax_megamoe.NvlinkWorkspace(mesh, "
            "axis_name, max_tokens=..., hidden=..., top_k=...)` once outside jit and pass "
            "transport=jax_megamoe.NvlinkTransport(ws)"
        )
    raise ValueError(
        f"transport must be one of {TRANSPORT_NAMES} or a Transport object such as "
        f"jax_megamoe.NvlinkTransport(workspace), got {transport!r}"
    )


@functools.cache
def ragged_supported() -> bool:
    """Whether `ragged_all_to_all` works here (probed once per process).

    XLA implements it on GPUs only (XLA:CPU rejects it at compile time), and within one process: across
    `jax.distributed` processes XLA refuses it ("RaggedAllToAll fallback to NCCL is not allowed").
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
