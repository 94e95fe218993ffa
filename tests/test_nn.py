"""flax.nnx MoE layer: parity with the pure-JAX reference (forward and gradients), aux outputs, capacity,
nnx transforms (jit, remat, scan over layers), sharding metadata, argument checks, the expert-parallel
`transport=` options (the nvlink transport on two GPUs: marker `gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from moe_cases import normal, rel_error

import jax_megamoe as jmm
from jax_megamoe import nn as jmnn
from jax_megamoe import reference

H, I, E, K = 16, 12, 6, 2


def make_layer(seed=0, **kwargs):
    return jmnn.MoE(H, I, E, K, rngs=nnx.Rngs(seed), **kwargs)


def expected(layer, x, dtype=jnp.float32):
    """The layer's math written with reference ops only (float32 router, weights cast to `dtype`)."""
    tokens = x.reshape(-1, H)
    logits = tokens.astype(jnp.float32) @ layer.router.kernel[...]
    weights, experts = reference.route(logits, K, True)
    y = reference.moe_ffn(
        tokens.astype(dtype), weights, experts, layer.w_gate_up[...].astype(dtype), layer.w_down[...].astype(dtype)
    )
    return y.reshape(x.shape), logits, experts


@pytest.mark.parametrize("implementation", ["cpu", "reference"])
def test_forward_and_grads_match_reference(implementation):
    layer = make_layer(implementation=implementation)
    x = normal("forward", (3, 7, H))
    y, _ = layer(x)
    np.testing.assert_allclose(y, expected(layer, x)[0], rtol=1e-5, atol=1e-6)

    def loss(layer, x, fn):
        out = fn(layer, x)
        return jnp.sum(jnp.sin(out))

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)), static_argnums=2)
    got = grad(layer, x, lambda m, x: m(x)[0])
    want = grad(layer, x, lambda m, x: expected(m, x)[0])
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_bfloat16_compute_close_to_float32():
    layer = make_layer(dtype=jnp.bfloat16)
    x = normal("bf16", (32, H))
    y, _ = layer(x)
    assert y.dtype == jnp.bfloat16
    assert rel_error(y, expected(layer, x)[0]) <= 1e-2


def test_aux_outputs():
    layer = make_layer()
    x = normal("aux", (40, H))
    _, aux = layer(x)
    _, logits, experts = expected(layer, x)
    np.testing.assert_allclose(aux.load_balancing_loss, reference.load_balancing_loss(logits, experts), rtol=1e-6)
    np.testing.assert_allclose(aux.router_z_loss, reference.router_z_loss(logits), rtol=1e-6)
    np.testing.assert_array_equal(aux.expert_counts, np.bincount(np.asarray(experts).ravel(), minlength=E))
    assert int(aux.dropped_pairs) == 0
    assert int(aux.expert_counts.sum()) == 40 * K


def test_capacity_drops_late_pairs_and_counts_them():
    layer = make_layer(capacity_factor=0.5)
    x = normal("capacity", (30, H))
    y, aux = layer(x)
    _, logits, experts = expected(layer, x)
    capacity = int(np.ceil(0.5 * 30 * K / E))
    flat = np.asarray(experts).ravel().copy()
    seen = np.zeros(E, int)
    for i, e in enumerate(flat):  # token-major order: earlier pairs keep their slot
        seen[e] += 1
        if seen[e] > capacity:
            flat[i] = -1
    assert int(aux.dropped_pairs) == int(np.sum(flat < 0)) > 0
    weights, _ = reference.route(logits, K, True)
    want = reference.moe_ffn(x, weights, flat.reshape(experts.shape), layer.w_gate_up[...], layer.w_down[...])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_ample_capacity_is_dropless():
    layer = make_layer(capacity_factor=float(E))
    x = normal("ample", (24, H))
    y, aux = layer(x)
    assert int(aux.dropped_pairs) == 0
    np.testing.assert_allclose(y, expected(layer, x)[0], rtol=1e-5, atol=1e-6)


def test_callable_implementation_is_used():
    calls = []

    def expert_fn(x, weights, experts, w_gate_up, w_down):
        calls.append(x.shape)
        return reference.moe_ffn(x, weights, experts, w_gate_up, w_down)

    layer = make_layer(implementation=expert_fn)
    x = normal("callable", (5, H))
    np.testing.assert_allclose(layer(x)[0], expected(layer, x)[0], rtol=1e-5, atol=1e-6)
    assert calls == [(5, H)]


def test_jit_and_remat():
    layer = make_layer()
    x = normal("remat", (2, 9, H))

    @nnx.jit
    def loss_and_grad(layer, x):
        def loss(layer):
            y, aux = nnx.remat(lambda m, x: m(x))(layer, x)
            return jnp.mean(y**2) + 0.01 * aux.load_balancing_loss

        return nnx.value_and_grad(loss)(layer)

    value, grads = loss_and_grad(layer, x)

    def eager_loss(layer):
        y, aux = layer(x)
        return jnp.mean(y**2) + 0.01 * aux.load_balancing_loss

    want_value, want_grads = nnx.value_and_grad(eager_loss)(layer)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_scan_over_layers():
    num_layers = 3

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return jmnn.MoE(H, I, E, K, rngs=rngs)

    stack = create(nnx.Rngs(0))
    assert stack.w_gate_up.shape == (num_layers, E, H, 2 * I)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def run(x, layer):
        y, aux = layer(x)
        return x + y, aux

    x = normal("scan", (10, H))
    out, aux = nnx.jit(run)(x, stack)
    assert aux.expert_counts.shape == (num_layers, E)

    want = x
    for i in range(num_layers):
        layer = make_layer()
        nnx.update(layer, jax.tree.map(lambda v, i=i: v[i], nnx.state(stack)))
        want = want + expected(layer, want)[0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_sharding_metadata():
    specs = nnx.get_partition_spec(nnx.state(make_layer(expert_axis="expert")))
    assert specs["w_gate_up"].get_value() == jax.sharding.PartitionSpec("expert", None, None)
    assert specs["w_down"].get_value() == jax.sharding.PartitionSpec("expert", None, None)
    assert specs["router"]["kernel"].get_value() == jax.sharding.PartitionSpec()


def test_parameters_are_created_sharded_under_a_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        layer = jmnn.MoE(H, I, 8, K, expert_axis="expert", rngs=nnx.Rngs(0))
    assert layer.w_gate_up[...].sharding.spec == jax.sharding.PartitionSpec("expert", None, None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=E + 1), "top_k"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(capacity_factor=0.0), "capacity_factor"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K) | kwargs
    with pytest.raises(ValueError, match=match):
        jmnn.MoE(**args, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "shape, expert_axis, capacity_factor",
    [
        ((2, 4), "expert", None),
        ((1, 8), "expert", None),
        ((2, 4), "expert", 8.0),
        ((8, 1), None, None),
    ],
)
def test_under_a_mesh_matches_one_device(shape, expert_axis, capacity_factor):
    """Under `jax.set_mesh` the layer runs per shard (expert-parallel with `expert_axis`); same result."""
    mesh = jax.make_mesh(shape, ("data", "expert"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    single = jmnn.MoE(H, I, 8, K, capacity_factor=capacity_factor, rngs=nnx.Rngs(0))
    x = normal("mesh", (8, 4, H))

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(jnp.sin(y)) + aux.load_balancing_loss, (y, aux)

    (_, (want_y, want_aux)), want_grads = nnx.value_and_grad(loss, has_aux=True)(single, x)
    with jax.set_mesh(mesh):
        layer = jmnn.MoE(H, I, 8, K, capacity_factor=capacity_factor, expert_axis=expert_axis, rngs=nnx.Rngs(0))
        x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P(("data", "expert"))))
        (_, (y, aux)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x_sharded)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(aux.expert_counts, want_aux.expert_counts)
    assert int(aux.dropped_pairs) == 0
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_expert_parallel_capacity_drops_are_counted():
    """EP capacity is per (source, destination) shard pair, so compare against dropless: the dropped
    pairs are reported and only the tokens that lost a pair change."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = normal("ep capacity", (64, H))
    with jax.set_mesh(mesh):
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P(("data", "expert"))))
        outputs = {}
        for factor in (None, 0.5):
            layer = jmnn.MoE(H, I, 8, K, capacity_factor=factor, expert_axis="expert", rngs=nnx.Rngs(0))
            outputs[factor] = nnx.jit(lambda m, x: m(x))(layer, x)
    (full, _), (capped, aux) = outputs[None], outputs[0.5]
    changed_tokens = int(np.sum(np.any(np.asarray(full) != np.asarray(capped), axis=-1)))
    assert 0 < changed_tokens <= int(aux.dropped_pairs) <= 64 * K


def test_expert_axis_must_be_a_mesh_axis():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    layer = make_layer(expert_axis="expert")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="expert_axis"):
        layer(jnp.zeros((8, H)))


def two_device_expert_mesh(devices):
    return jax.sharding.Mesh(np.array(devices[:2]), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.parametrize(
    "transport, error, match",
    [
        ("ragged", ValueError, "transport='ragged'"),  # XLA:CPU has no ragged_all_to_all
        ("nccl", ValueError, "transport must be"),
    ],
)
def test_ep_transport_errors_surface_through_the_layer(transport, error, match):
    """moe_ffn_ep's own messages for a transport that cannot run reach the caller; the transport is a static
    attribute, not state."""
    mesh = two_device_expert_mesh(jax.devices())
    with jax.set_mesh(mesh):
        layer = jmnn.MoE(H, I, 8, K, expert_axis="expert", transport=transport, rngs=nnx.Rngs(0))
        assert set(nnx.state(layer)) == {"router", "w_gate_up", "w_down"}
        x = jax.device_put(jnp.zeros((8, H)), jax.sharding.NamedSharding(mesh, jax.P("expert")))
        with pytest.raises(error, match=match):
            nnx.jit(lambda m, x: m(x))(layer, x)


@pytest.mark.parametrize("old", [{"backend": "cpu"}, {"ep_backend": "xla"}, {"ep_workspace": None}])
def test_old_keywords_are_gone(old):
    with pytest.raises(TypeError):
        make_layer(**old)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_two_gpus_nvlink_layer_equals_xla_layer(gpus, dtype):
    """The layer with transport=NvlinkTransport(workspace) gives the "xla" transport's output, aux and
    gradients bit for bit (float32: through the fallback to "xla", tests/test_nvlink_gpu.py)."""
    hidden, inter, experts, tokens = 64, 32, 8, 256
    mesh = two_device_expert_mesh(gpus)
    x = normal("two gpus", (4, tokens // 4, hidden))

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))) + aux.load_balancing_loss, (y, aux)

    results = {}
    with (
        jax.set_mesh(mesh),
        jmm.NvlinkWorkspace(mesh, "expert", max_tokens=tokens // 2, hidden=hidden, top_k=K, dtype=dtype) as workspace,
    ):
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("expert")))
        for name, transport in (("xla", "xla"), ("nvlink", jmm.NvlinkTransport(workspace))):
            layer = jmnn.MoE(
                hidden, inter, experts, K, expert_axis="expert", transport=transport, dtype=dtype, rngs=nnx.Rngs(0)
            )
            assert set(nnx.state(layer)) == {"router", "w_gate_up", "w_down"}
            (_, outputs), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(layer, x)
            results[name] = jax.device_get((outputs, grads))
    assert np.all(np.isfinite(np.asarray(results["xla"][0][0], np.float32)))
    for got, want in zip(jax.tree.leaves(results["nvlink"]), jax.tree.leaves(results["xla"]), strict=True):
        np.testing.assert_array_equal(got, want)
