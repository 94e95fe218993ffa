"""Linen MoE layer: same results as the NNX layer with the same parameters, gradients, partitioning boxes,
the expert-parallel `transport=` options."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from moe_cases import normal

from jax_megamoe import linen as jmlinen
from jax_megamoe import nn as jmnn

H, I, E, K = 16, 8, 4, 2


def nnx_twin(params, **kwargs):
    """An NNX layer holding the Linen layer's parameters."""
    layer = jmnn.MoE(H, I, E, K, rngs=nnx.Rngs(0), **kwargs)
    layer.router.kernel[...] = params["router"]["kernel"]
    layer.w_gate_up[...] = params["w_gate_up"]
    layer.w_down[...] = params["w_down"]
    return layer


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_linen_matches_nnx_forward_and_grads(capacity_factor):
    module = jmlinen.MoE(I, E, K, capacity_factor=capacity_factor, implementation="cpu")
    x = normal("linen", (2, 11, H))
    params = module.init(jax.random.key(1), x)["params"]
    y, aux = module.apply({"params": params}, x)
    twin = nnx_twin(params, capacity_factor=capacity_factor, implementation="cpu")
    want_y, want_aux = twin(x)
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
    for got, want in zip(jax.tree.leaves(aux), jax.tree.leaves(want_aux), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)

    def loss(params):
        y, aux = module.apply({"params": params}, x)
        return jnp.sum(jnp.tanh(y)) + aux.load_balancing_loss

    def twin_loss(layer):
        y, aux = layer(x)
        return jnp.sum(jnp.tanh(y)) + aux.load_balancing_loss

    grads = jax.jit(jax.grad(loss))(params)
    want = nnx.jit(nnx.grad(twin_loss))(twin)
    np.testing.assert_allclose(grads["w_gate_up"], want.w_gate_up[...], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads["w_down"], want.w_down[...], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(grads["router"]["kernel"], want.router.kernel[...], rtol=1e-4, atol=1e-6)


def test_partitioning_boxes_name_the_expert_axis():
    module = jmlinen.MoE(I, E, K, expert_axis="expert")
    variables = module.init(jax.random.key(0), jnp.zeros((4, H)))
    specs = nn.get_partition_spec(variables)["params"]
    assert specs["w_gate_up"] == jax.sharding.PartitionSpec("expert", None, None)
    assert specs["w_down"] == jax.sharding.PartitionSpec("expert", None, None)
    assert nn.unbox(variables)["params"]["w_gate_up"].shape == (E, H, 2 * I)


def test_bf16_compute_dtype():
    module = jmlinen.MoE(I, E, K, dtype=jnp.bfloat16)
    x = normal("linen bf16", (8, H))
    params = module.init(jax.random.key(3), x)["params"]
    y, _ = module.apply({"params": params}, x)
    assert y.dtype == jnp.bfloat16
    want, _ = nnx_twin(params)(x)
    assert np.linalg.norm(np.asarray(y, np.float32) - want) <= 1e-2 * np.linalg.norm(want)


def test_expert_parallel_under_a_mesh_matches_one_device():
    module = jmlinen.MoE(I, 8, K, expert_axis="expert")
    x = normal("linen mesh", (16, H))
    variables = module.init(jax.random.key(5), x)
    want, _ = module.apply(variables, x)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        shardings = nn.get_sharding(variables, mesh)
        variables = jax.device_put(variables, shardings)
        got, aux = jax.jit(module.apply)(variables, x)
    assert variables["params"]["w_gate_up"].value.sharding.spec == jax.sharding.PartitionSpec("expert", None, None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(aux.dropped_pairs) == 0


@pytest.mark.parametrize(
    "transport, match",
    [
        ("ragged", "transport='ragged'"),  # XLA:CPU has no ragged_all_to_all
        ("nccl", "transport must be"),
    ],
)
def test_ep_transport_errors_surface_through_the_layer(transport, match):
    """moe_ffn_ep's own messages for a transport that cannot run reach the caller."""
    module = jmlinen.MoE(I, 8, K, expert_axis="expert", transport=transport)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        module.init(jax.random.key(0), jnp.zeros((8, H)))


def test_implementation_and_transport_are_the_attribute_names():
    module = jmlinen.MoE(I, E, K, implementation="reference", transport="xla")
    assert (module.implementation, module.transport) == ("reference", "xla")
    for old in ("backend", "ep_backend", "ep_workspace"):
        assert not hasattr(module, old), old


def test_fp8_recipe_reaches_the_experts():
    """`recipe="fp8_blockwise"` on the Linen layer: the NNX layer's result with the same recipe bit for bit, and not
    the bf16 result (the experts' GEMMs see quantised operands), though close to it."""
    module = jmlinen.MoE(I, E, K, dtype=jnp.bfloat16, recipe="fp8_blockwise", implementation="reference")
    x = normal("linen fp8", (64, H))
    params = module.init(jax.random.key(4), x)["params"]
    y, _ = module.apply({"params": params}, x)
    want, _ = nnx_twin(params, dtype=jnp.bfloat16, recipe="fp8_blockwise", implementation="reference")(x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
    plain, _ = nnx_twin(params, dtype=jnp.bfloat16, implementation="reference")(x)
    err = np.linalg.norm(np.asarray(y, np.float32) - np.asarray(plain, np.float32))
    assert 0 < err <= 0.1 * np.linalg.norm(np.asarray(plain, np.float32))
