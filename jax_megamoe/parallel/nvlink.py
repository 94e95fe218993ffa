"""The NVLink transport of `moe_ffn_ep`: block exchanges by direct stores into the peers' GPU memory.

`NvlinkWorkspace` owns memory outside XLA on every GPU of the expert axis (staging blocks and signal
counters, docs/nvlink_design.md); `exchange` moves `[ep, C, ...]` blocks through it with the semantics
of `transport.ragged_blocks`. Only the live rows cross NVLink, with no NCCL call and no host
synchronisation. Every wait on a peer is bounded: a peer that never arrives fails the computation with
a message naming the shard and the phase instead of hanging it.

Emulation: `NvlinkWorkspace.emulated(R, ...)` puts R shards' memory on one GPU; calling `moe_ffn_ep`
under `jax.vmap(..., axis_name=...)` over R then runs the same kernels and the same protocol with all R
shards in one call, which is how the transport is tested on one GPU.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi

MAX_RANKS = 8  # kMaxRanks of jmm/nvlink_cuda.h
DEFAULT_TIMEOUT_MS = 10_000  # far above any legitimate wait; JMM_NVLINK_TIMEOUT_MS overrides
# Thread blocks per peer in each copy kernel. Measured at EP = 2, q30 (RESULTS.md): 16 -> 4.16 / 10.33 ms
# forward / forward+backward, 32 -> 3.88 / 9.82, 64 -> 3.77 / 9.58, 128 and 256 no better than 64.
# JMM_NVLINK_BLOCKS_PER_PEER overrides, for measuring. Every process must use the same value.
DEFAULT_BLOCKS_PER_PEER = 64


def block_bytes(max_tokens: int, hidden: int, top_k: int, dtype) -> int:
    """Staging bytes per (source, destination) block for tokens of `hidden` features in `dtype`.

    `moe_ffn_ep` sends at most one row per token to each shard (deduplicated over the shard's experts):
    token rows (`hidden` elements), the local expert ids and routing weights (`top_k` 4-byte values each),
    and in the backward their cotangents; the largest of these sets the block size. Each GPU holds
    `ep * block_bytes` of staging (q30 at ep = 8, bf16: 8 * 16384 * 4096 B = 512 MiB), twice that with
    `overlap=True` (stage 2's push slots).
    """
    for name, value in (("max_tokens", max_tokens), ("hidden", hidden), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return max_tokens * max(hidden * jnp.dtype(dtype).itemsize, top_k * 4)


def _positive_env(name: str, default: int, limit: int = 2**62) -> int:
    value = os.environ.get(name, str(default))
    if not value.isdigit() or not 1 <= int(value) <= limit:
        raise ValueError(f"{name} must be an integer in [1, {limit}], got {value!r}")
    return int(value)


def _cuda_extension():
    if not _ffi.has_cuda_kernels():
        raise ValueError("the nvlink transport needs jax_megamoe built with its CUDA kernels (nvcc present at "
                         "install time); use moe_ffn_ep backend 'xla' or 'ragged'")
    return _ffi.extension()


def _check_overlap(overlap) -> None:
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool (True: stage 2's overlapped forward and backward where they apply, "
                        f"False: stage 1 everywhere), got {overlap!r}")


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
    for g, (row, handles) in enumerate(zip(groups, ext.nvlink_export(workspace_id))):
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
                        f"host {peer_host.decode()!r}, this process on {host!r}; use backend='xla' across hosts")
                ext.nvlink_attach(workspace_id, g, r, peer)


class NvlinkWorkspace:
    """Symmetric memory for `moe_ffn_ep(..., backend="nvlink", workspace=...)` on one mesh axis.

    Create it once (outside `jit`), reuse it for every MoE layer and step, `close()` it when done (or use
    it as a context manager). Sized by `block_bytes(max_tokens, hidden, top_k, dtype)`: a call with more
    tokens per shard, or wider rows, fails with a message saying so.

    Args:
      mesh: the `jax.sharding.Mesh` that `shard_map` runs over (GPUs of one host: NVLink or PCIe peers).
      axis_name: the expert axis; one exchange group is made per combination of the other axes.
      max_tokens: the most tokens a shard passes to `moe_ffn_ep` (per call).
      hidden, top_k, dtype: the token width, routing fan-out and compute dtype of the MoE layers.
      overlap: stage 2's overlapped calls where they apply (bf16, tensor-core shapes, the cuda local backend;
        `nvlink_experts.py`): the rows go to the experts by the copy engines beside the gate_up GEMM of the
        shard's own rows, and their cotangent comes back beside the backward's last GEMM. It doubles the staging
        memory (push slots). Measured at EP = 2, q30 on two H200s (benchmarks/RESULTS.md, 2026-11-30 16:33 UTC):
        forward 12% and forward+backward 6% faster than "xla" with uniform routing, 5% and 1% with Zipf routing;
        1000 steps beside NCCL collectives without a hang; across processes through CUDA IPC too.
        `overlap=False` keeps stage 1 everywhere (half the staging).

    With one process per GPU (`jax.distributed`), every process constructs it (in the same order as
    its other workspaces); the processes swap CUDA IPC handles through the distributed key-value store.
    An expert group spanning processes must have one GPU per process.

    Making it loads every CUDA kernel of jax_megamoe on its devices: CUDA loads kernels lazily by default, and a
    load can wait for running kernels, so a first launch beside a kernel that waits for a peer could stall both
    until the wait's bound (docs/nvlink_design.md, "A first-call timeout"). Other libraries' kernels that a program
    launches between the transport's calls are not covered; `CUDA_MODULE_LOADING=EAGER` covers them too.
    """

    _serial = 0  # multi-process workspaces made so far: names their key-value entries

    def __init__(self, mesh, axis_name: str = "expert", *, max_tokens: int, hidden: int, top_k: int,
                 dtype=jnp.bfloat16, overlap: bool = True):
        _check_overlap(overlap)
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
        devices = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis_name), -1)
        groups = [[_ordinal(d) for d in row] for row in devices.reshape(-1, devices.shape[-1])]
        # Each process builds the groups it has a GPU in; with one process per GPU, the others' ranks
        # are mapped through CUDA IPC. Every process must create its workspaces in the same order.
        global_index = [g for g, row in enumerate(groups) if any(o != REMOTE for o in row)]
        groups = [groups[g] for g in global_index]
        self._create(groups, False, block_bytes(max_tokens, hidden, top_k, dtype), overlap)
        if any(REMOTE in row for row in groups):
            NvlinkWorkspace._serial += 1
            _exchange_handles(_ffi.extension(), self.id, groups, global_index, NvlinkWorkspace._serial)

    @classmethod
    def emulated(cls, ranks: int, *, max_tokens: int, hidden: int, top_k: int, dtype=jnp.bfloat16,
                 device=None, overlap: bool = True) -> "NvlinkWorkspace":
        """R emulated shards on one GPU (`device`, default the first): for `moe_ffn_ep` under
        `jax.vmap(..., axis_name=...)` over R, running the real kernels and protocol without NVLink.
        `overlap` as for the constructor."""
        _check_overlap(overlap)
        device = jax.devices()[0] if device is None else device
        workspace = cls.__new__(cls)
        workspace._create([[_ordinal(device)] * ranks], True, block_bytes(max_tokens, hidden, top_k, dtype),
                          overlap)
        return workspace

    def _create(self, groups, emulated: bool, size: int, overlap: bool) -> None:
        ranks = len(groups[0])
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"the nvlink transport supports expert axes of 1 to {MAX_RANKS} GPUs, got {ranks}")
        ext = _cuda_extension()
        try:
            self.id = int(ext.nvlink_create(
                groups, emulated, size, _positive_env("JMM_NVLINK_TIMEOUT_MS", DEFAULT_TIMEOUT_MS),
                _positive_env("JMM_NVLINK_BLOCKS_PER_PEER", DEFAULT_BLOCKS_PER_PEER, 1024), overlap))
        except RuntimeError as err:
            raise ValueError(str(err)) from None
        self.ranks = ranks
        self.emulated = emulated
        self.block_bytes = size
        self.overlap = overlap
        self._finalizer = weakref.finalize(self, ext.nvlink_destroy, self.id)

    def close(self) -> None:
        """Frees the workspace after the GPUs finish their queued work; later calls with it fail."""
        self._finalizer()

    def __enter__(self) -> "NvlinkWorkspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_fits(self, capacity: int, row_bytes: int) -> None:
        """Raises if blocks of `capacity` rows of `row_bytes` bytes do not fit the staging blocks."""
        if capacity * row_bytes > self.block_bytes:
            raise ValueError(f"nvlink workspace too small: blocks of {capacity} rows x {row_bytes} bytes need "
                             f"{capacity * row_bytes} bytes, it holds {self.block_bytes} per block; create it with "
                             f"max_tokens >= the tokens per shard and the layer's hidden size, top_k and dtype")


def _fill_byte(dtype, fill_value) -> int:
    """The byte whose repetition spells `fill_value` in `dtype` (0, or -1 for integers)."""
    if fill_value == 0:
        return 0
    if fill_value == -1 and jnp.issubdtype(dtype, jnp.signedinteger):
        return 0xFF
    raise ValueError(f"the nvlink transport fills with 0 (or -1 for integers), got {fill_value!r} for {dtype}")


def exchange(buffer: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, workspace: NvlinkWorkspace,
             fill_value=0) -> jax.Array:
    """`transport.ragged_blocks` through the workspace: the first `send_counts[d]` rows of block d go to
    shard d; in the result, rows of block s past `recv_counts[s]` hold `fill_value`. Linear; its
    transpose is the reverse exchange."""
    row_bytes = math.prod(buffer.shape[2:]) * buffer.dtype.itemsize
    workspace.check_fits(buffer.shape[1], row_bytes)
    return _exchange(buffer, send_counts.astype(jnp.int32), recv_counts.astype(jnp.int32), workspace.id,
                     _fill_byte(buffer.dtype, fill_value))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _exchange(buffer, send_counts, recv_counts, workspace_id: int, fill_byte: int):
    (out,) = _ffi.call("cuda", "nvlink_exchange", (jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),),
                       buffer, send_counts, recv_counts, vmap_method="broadcast_all",
                       workspace=np.int64(workspace_id), fill_byte=np.int64(fill_byte))
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
