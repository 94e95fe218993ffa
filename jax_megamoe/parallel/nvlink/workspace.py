"""The nvlink transport's memory: `NvlinkWorkspace`, symmetric buffers outside XLA on every GPU of an axis.

Each GPU holds, per peer, a staging block for the plain exchanges (expert ids, routing weights and their
cotangents) and a push slot for the fused calls' row blocks, plus the signal counters of both protocols
(docs/expert_parallelism.md). Every wait on a peer is bounded by `timeout_ms`: a peer that never arrives
fails the computation with a message naming the shard and the phase instead of hanging it.

Emulation: `NvlinkWorkspace.emulated(R, ...)` puts R shards' memory on one GPU; `moe_ffn_ep` under
`jax.vmap(..., axis_name=...)` over R then runs the same kernels and protocol with all R shards in each call,
which is how the transport is tested on one GPU.
"""

from __future__ import annotations

import numbers
import socket
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi

MAX_RANKS = 8  # kMaxRanks of the nvlink workspace (cuda/nvlink/)
DEFAULT_TIMEOUT_MS = 10_000  # far above any legitimate wait
# Thread blocks per peer in each copy kernel: the fastest count tried on the q30 exchange over two GPUs (fewer were
# slower, more no faster). Every process of a run must use the same value.
DEFAULT_BLOCKS_PER_PEER = 64


def block_bytes(max_tokens: int, hidden: int, top_k: int, dtype) -> int:
    """Staging bytes per (source, destination) block for tokens of `hidden` features in `dtype`.

    `moe_ffn_ep` sends at most one row per token to each shard (deduplicated over the shard's experts):
    token rows (`hidden` elements), the local expert ids and routing weights (`top_k` 4-byte values each),
    and in the backward their cotangents; the largest of these sets the block size. Each GPU holds
    `2 * ep * block_bytes`: the plain exchanges' staging and the fused calls' push slots (q30 at ep = 8, bf16:
    2 * 8 * 16384 * 4096 B = 1 GiB).
    """
    for name, value in (("max_tokens", max_tokens), ("hidden", hidden), ("top_k", top_k)):
        _check_positive(name, value)
    return max_tokens * max(hidden * jnp.dtype(dtype).itemsize, top_k * 4)


def _check_positive(name: str, value, limit: int = 2**62) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= int(value) <= limit:
        raise ValueError(f"{name} must be an int in [1, {limit}], got {value!r}")


def _cuda_extension():
    if not _ffi.has_cuda_kernels():
        raise ValueError(
            "the nvlink transport needs jax_megamoe built with its CUDA kernels (nvcc present at "
            "install time); use transport='xla' or 'ragged'"
        )
    return _ffi.extension()


REMOTE = -1  # a rank of another process (kRemote of cuda/ffi/nvlink_cuda.cc)
_KV_TIMEOUT_MS = 300_000


def _ordinal(device) -> int:
    """The CUDA device index of `device` in this process, or REMOTE for another process's GPU."""
    if device.platform != "gpu":
        raise ValueError(f"the nvlink transport runs on GPUs, got a {device.platform!r} device ({device})")
    return device.local_hardware_id if device.process_index == jax.process_index() else REMOTE


def _exchange_handles(ext, workspace_id: int, groups, global_index, serial: int) -> None:
    """Swaps CUDA IPC handles with the other processes through the jax.distributed key-value store.

    `groups` are this process's groups (ordinals, REMOTE for other processes' ranks), `global_index[i]`
    the position of groups[i] among all the mesh's groups, the same in every process.
    """
    from jax._src import distributed  # the key-value store has no public API yet

    client = distributed.global_state.client
    if client is None:
        raise ValueError("the expert axis spans processes: call jax.distributed.initialize() first")
    key = "jax_megamoe/nvlink/{}/{}/{}".format
    # Each entry is "host\n" + handles: an IPC handle only opens on the host that made it, so a peer on
    # another host gets a clear error instead of a CUDA failure.
    host = socket.gethostname()
    for g, (row, handles) in enumerate(zip(groups, ext.nvlink_export(workspace_id), strict=True)):
        if REMOTE not in row:
            continue
        mine = next(r for r, ordinal in enumerate(row) if ordinal != REMOTE)
        client.key_value_set_bytes(key(serial, global_index[g], mine), host.encode() + b"\n" + handles)
        for r, ordinal in enumerate(row):
            if ordinal == REMOTE:
                entry = client.blocking_key_value_get_bytes(key(serial, global_index[g], r), _KV_TIMEOUT_MS)
                peer_host, _, peer = entry.partition(b"\n")
                if peer_host.decode() != host:
                    raise ValueError(
                        f"the nvlink transport needs the expert axis on GPUs of one host: rank {r} is on "
                        f"host {peer_host.decode()!r}, this process on {host!r}; use transport='xla' across hosts"
                    )
                ext.nvlink_attach(workspace_id, g, r, peer)


class NvlinkWorkspace:
    """Symmetric memory for the nvlink transport of `moe_ffn_ep` on one mesh axis.

    Create it once (outside `jit`), wrap it in `NvlinkTransport(workspace)` for `moe_ffn_ep(transport=...)`,
    reuse it for every MoE layer and step, and `close()` it when done (or use it as a context manager). Sized
    by `block_bytes(max_tokens, hidden, top_k, dtype)`: a call with more tokens per shard, or wider rows, fails
    with a message saying so.

    Args:
      mesh: the `jax.sharding.Mesh` that `shard_map` runs over (GPUs of one host: NVLink or PCIe peers).
      axis_name: the expert axis; one exchange group is made per combination of the other axes.
      max_tokens: the most tokens a shard passes to `moe_ffn_ep` (per call).
      hidden, top_k, dtype: the token width, routing fan-out and compute dtype of the MoE layers.
      timeout_ms: the bound of every wait on a peer; past it the computation fails naming the shard, the
        phase and the peer.
      blocks_per_peer: thread blocks per peer in each copy kernel (the same in every process).

    With one process per GPU (`jax.distributed`), every process constructs it (in the same order as
    its other workspaces); the processes swap CUDA IPC handles through the distributed key-value store.
    An expert group spanning processes must have one GPU per process.

    Making it loads every CUDA kernel of jax_megamoe on its devices: CUDA loads kernels lazily by default, and a
    load can wait for running kernels, so a first launch beside a kernel that waits for a peer could stall both
    until the wait's bound. Other libraries' kernels that a program launches between the transport's calls are
    not covered; `CUDA_MODULE_LOADING=EAGER` covers them too.
    """

    _serial = 0  # multi-process workspaces made so far: names their key-value entries

    def __init__(
        self,
        mesh,
        axis_name: str = "expert",
        *,
        max_tokens: int,
        hidden: int,
        top_k: int,
        dtype=jnp.bfloat16,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        blocks_per_peer: int = DEFAULT_BLOCKS_PER_PEER,
    ):
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        devices = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis_name), -1)
        groups = [[_ordinal(d) for d in row] for row in devices.reshape(-1, devices.shape[-1])]
        # Each process builds the groups it has a GPU in; with one process per GPU, the others' ranks
        # are mapped through CUDA IPC. Every process must create its workspaces in the same order.
        global_index = [g for g, row in enumerate(groups) if any(o != REMOTE for o in row)]
        groups = [groups[g] for g in global_index]
        self._create(groups, False, block_bytes(max_tokens, hidden, top_k, dtype), timeout_ms, blocks_per_peer)
        if any(REMOTE in row for row in groups):
            NvlinkWorkspace._serial += 1
            _exchange_handles(_ffi.extension(), self.id, groups, global_index, NvlinkWorkspace._serial)

    @classmethod
    def emulated(
        cls,
        ranks: int,
        *,
        max_tokens: int,
        hidden: int,
        top_k: int,
        dtype=jnp.bfloat16,
        device=None,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        blocks_per_peer: int = DEFAULT_BLOCKS_PER_PEER,
    ) -> NvlinkWorkspace:
        """R emulated shards on one GPU (`device`, default the first): for `moe_ffn_ep` under
        `jax.vmap(..., axis_name=...)` over R, running the real kernels and protocol without NVLink."""
        device = jax.devices()[0] if device is None else device
        workspace = cls.__new__(cls)
        workspace._create(
            [[_ordinal(device)] * ranks],
            True,
            block_bytes(max_tokens, hidden, top_k, dtype),
            timeout_ms,
            blocks_per_peer,
        )
        return workspace

    def _create(self, groups, emulated: bool, size: int, timeout_ms: int, blocks_per_peer: int) -> None:
        ranks = len(groups[0])
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"the nvlink transport supports expert axes of 1 to {MAX_RANKS} GPUs, got {ranks}")
        _check_positive("timeout_ms", timeout_ms)
        _check_positive("blocks_per_peer", blocks_per_peer, 1024)
        ext = _cuda_extension()
        try:
            self.id = int(ext.nvlink_create(groups, emulated, size, int(timeout_ms), int(blocks_per_peer)))
        except RuntimeError as err:
            raise ValueError(str(err)) from None
        self.ranks = ranks
        self.is_emulated = emulated
        self.block_bytes = size
        self._finalizer = weakref.finalize(self, ext.nvlink_destroy, self.id)

    def close(self) -> None:
        """Frees the workspace after the GPUs finish their queued work; later calls with it fail."""
        self._finalizer()

    def __enter__(self) -> NvlinkWorkspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_fits(self, capacity: int, row_bytes: int) -> None:
        """Raises if blocks of `capacity` rows of `row_bytes` bytes do not fit the staging blocks."""
        if capacity * row_bytes > self.block_bytes:
            raise ValueError(
                f"nvlink workspace too small: blocks of {capacity} rows x {row_bytes} bytes need "
                f"{capacity * row_bytes} bytes, it holds {self.block_bytes} per block; create it with "
                f"max_tokens >= the tokens per shard and the layer's hidden size, top_k and dtype"
            )
