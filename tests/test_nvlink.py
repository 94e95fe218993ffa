"""The NVLink transport's CPU-checkable parts: workspace sizing, fill values and argument checks.

The kernels themselves run in tests/test_nvlink_gpu.py (emulated shards on one GPU, and two GPUs).
"""

from __future__ import annotations

import functools
import socket

import jax
import jax.numpy as jnp
import numpy as np

import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_megamoe as jmm
from jax_megamoe.parallel import nvlink


def test_block_bytes_is_the_widest_row_times_tokens():
    # q30 at bf16: token rows (2048 x 2 B) are wider than the 8 ids or weights (8 x 4 B).
    assert nvlink.block_bytes(16384, 2048, 8, jnp.bfloat16) == 16384 * 4096
    # A narrow layer with a wide fan-out: the routing rows set the size.
    assert nvlink.block_bytes(10, 2, 8, jnp.float32) == 10 * 32


@pytest.mark.parametrize("name, value", [("max_tokens", 0), ("hidden", -1), ("top_k", 2.0), ("max_tokens", True)])
def test_block_bytes_rejects_bad_sizes(name, value):
    sizes = dict(max_tokens=4, hidden=8, top_k=2)
    sizes[name] = value
    with pytest.raises(ValueError, match=name):
        nvlink.block_bytes(dtype=jnp.float32, **sizes)


def test_fill_bytes():
    assert nvlink._fill_byte(jnp.bfloat16, 0) == 0
    assert nvlink._fill_byte(jnp.int32, -1) == 0xFF
    with pytest.raises(ValueError, match="fills with 0"):
        nvlink._fill_byte(jnp.float32, -1)


def test_workspace_needs_gpus():
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    with pytest.raises(ValueError, match="GPU|CUDA kernels"):
        jmm.NvlinkWorkspace(mesh, "expert", max_tokens=8, hidden=16, top_k=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="GPU|CUDA kernels"):
        jmm.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=16, top_k=2, dtype=jnp.float32)


def test_workspace_rejects_unknown_axis():
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ValueError, match="not an axis"):
        jmm.NvlinkWorkspace(mesh, "expert", max_tokens=8, hidden=16, top_k=2)


def _run_ep(**options):
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    spec = P("expert")
    x = jnp.ones((8, 16))
    weights = jnp.full((8, 2), 0.5)
    ids = jnp.tile(jnp.array([[0, 3]], jnp.int32), (8, 1))
    w_gate_up, w_down = jnp.ones((4, 16, 8)), jnp.ones((4, 4, 16))
    fn = jax.shard_map(functools.partial(jmm.moe_ffn_ep, **options), mesh=mesh, in_specs=(spec,) * 5,
                       out_specs=spec)
    return fn(x, weights, ids, w_gate_up, w_down)


def test_nvlink_backend_needs_a_workspace():
    with pytest.raises(ValueError, match="needs workspace=NvlinkWorkspace"):
        _run_ep(backend="nvlink")


def test_workspace_only_with_nvlink():
    with pytest.raises(ValueError, match="only used by backend='nvlink'"):
        _run_ep(backend="xla", workspace=object())


class _FakeStore:
    """The jax.distributed key-value store of two processes, as seen by one of them."""

    def __init__(self, peers):
        self.values = dict(peers)
        self.set_keys = []

    def key_value_set_bytes(self, key, value):
        self.set_keys.append(key)
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        return self.values[key]


class _FakeExtension:
    def __init__(self, exported):
        self.exported = exported
        self.attached = []

    def nvlink_export(self, workspace_id):
        return self.exported

    def nvlink_attach(self, workspace_id, group, rank, handles):
        self.attached.append((workspace_id, group, rank, handles))


def test_ipc_handles_are_swapped_under_global_group_names(monkeypatch):
    from jax._src import distributed
    host = socket.gethostname().encode()
    # This process holds rank 1 of global group 3 (its only group); rank 0 belongs to another process.
    # Binary handles may contain the separator: only the first newline ends the host name.
    store = _FakeStore({"jax_megamoe/nvlink/7/3/0": host + b"\npe\ner"})
    monkeypatch.setattr(distributed.global_state, "client", store)
    ext = _FakeExtension([b"mine"])
    nvlink._exchange_handles(ext, 42, [[nvlink.REMOTE, 0]], [3], 7)
    assert store.set_keys == ["jax_megamoe/nvlink/7/3/1"]
    assert store.values["jax_megamoe/nvlink/7/3/1"] == host + b"\nmine"
    assert ext.attached == [(42, 0, 0, b"pe\ner")]


def test_ipc_peer_on_another_host_is_refused(monkeypatch):
    from jax._src import distributed
    store = _FakeStore({"jax_megamoe/nvlink/1/0/0": b"elsewhere-node\nhandles"})
    monkeypatch.setattr(distributed.global_state, "client", store)
    ext = _FakeExtension([b"mine"])
    with pytest.raises(ValueError, match="rank 0 is on host 'elsewhere-node'.*backend='xla'"):
        nvlink._exchange_handles(ext, 1, [[nvlink.REMOTE, 0]], [0], 1)
    assert ext.attached == []


def test_ipc_needs_jax_distributed(monkeypatch):
    from jax._src import distributed
    monkeypatch.setattr(distributed.global_state, "client", None)
    with pytest.raises(ValueError, match="jax.distributed.initialize"):
        nvlink._exchange_handles(_FakeExtension([b"x"]), 1, [[nvlink.REMOTE, 0]], [0], 1)


@pytest.mark.parametrize("value", ["0", "1025", "x", "-3"])
def test_bad_blocks_per_peer_env(monkeypatch, value):
    monkeypatch.setenv("JMM_NVLINK_BLOCKS_PER_PEER", value)
    with pytest.raises(ValueError, match="JMM_NVLINK_BLOCKS_PER_PEER"):
        nvlink._positive_env("JMM_NVLINK_BLOCKS_PER_PEER", 16, 1024)
