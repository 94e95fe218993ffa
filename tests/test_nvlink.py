"""The NVLink transport's CPU-checkable parts: workspace sizing, fill values and argument checks.

The kernels themselves run in tests/test_nvlink_gpu.py (emulated shards on one GPU, and two GPUs).
"""

from __future__ import annotations

import functools

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
