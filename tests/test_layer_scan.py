"""`jax_megamoe.models.layer_scan.scan` against `jax.lax.scan`: values and gradients of every argument, integer
outputs, remat inside the layer; what it stacks (the layer's inputs among its residuals are not copied); a
`prepare` cast run per layer, its gradients stacked in its dtype; the model's expert weights never stacked as
residuals."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_megamoe.models import layer_scan, qwen3_moe

L, B, H = 3, 4, 8


def problem(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    params = {"w": jax.random.normal(k[0], (L, H, H)) / H**0.5, "b": jax.random.normal(k[1], (L, H))}
    return params, jax.random.normal(k[2], (B, H)), (jax.random.normal(k[3], (H,)),)


def layer(params, c, consts):
    (scale,) = consts
    h = jnp.tanh(c @ params["w"] + params["b"]) * scale
    return c + h, {"energy": jnp.sum(h**2), "positive": jnp.sum(h > 0).astype(jnp.int32)}


def reference(fn, params, carry, consts):
    return jax.lax.scan(lambda c, p: fn(p, c, consts), carry, params)


def loss(scan, fn, params, carry, consts):
    c, ys = scan(fn, params, carry, consts)
    return jnp.sum(c**2) + jnp.sum(ys["energy"] * jnp.arange(1.0, L + 1)), ys["positive"]


@pytest.mark.parametrize("remat", [False, True])
def test_matches_lax_scan(remat):
    fn = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable) if remat else layer
    args = problem()
    grad = jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True)
    (value, positive), grads = jax.jit(grad, static_argnums=(0, 1))(layer_scan.scan, fn, *args)
    (ref_value, ref_positive), ref_grads = jax.jit(grad, static_argnums=(0, 1))(reference, fn, *args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_array_equal(positive, ref_positive)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def stacks(jaxpr) -> list[tuple[tuple, jnp.dtype]]:
    """The shapes and dtypes of the buffers `jaxpr` makes from nothing: `lax.empty` (one device) or zeros from
    a literal (several devices, where the scan zero-fills its stacks)."""
    found = []
    for eqn in jaxpr.eqns:
        made = eqn.primitive.name == "empty" or (
            eqn.primitive.name == "broadcast_in_dim" and isinstance(eqn.invars[0], jax.extend.core.Literal)
        )
        if made:
            found.append((tuple(eqn.outvars[0].aval.shape), eqn.outvars[0].aval.dtype))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += stacks(sub)
    return found


def stack_shapes(jaxpr) -> list[tuple]:
    return [shape for shape, _ in stacks(jaxpr)]


def test_inputs_among_the_residuals_are_not_stacked():
    # x @ w keeps x (the carry: stacked) and w (a parameter slice: sliced again in the backward, not stacked).
    def matmul_layer(params, c, consts):
        return jnp.tanh(c @ params["w"]), None

    params, x, consts = problem()
    step = jax.grad(lambda p, x: jnp.sum(layer_scan.scan(matmul_layer, p, x, consts)[0]), argnums=(0, 1))
    shapes = stack_shapes(jax.make_jaxpr(step)(params, x).jaxpr)
    assert shapes.count((L, B, H)) >= 1  # the carry
    assert shapes.count((L, H, H)) == 1  # w's gradient, no copy of w


@pytest.mark.parametrize("remat", [False, True])
def test_model_does_not_stack_the_expert_weights(remat):
    config = qwen3_moe.tiny()
    model = qwen3_moe.Qwen3MoeForCausalLM(
        config, dtype=jnp.bfloat16, implementation="cpu", remat=remat, rngs=nnx.Rngs(0)
    )
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((2, 8), jnp.int32)

    def loss(state):
        logits, aux = nnx.merge(graphdef, state)(ids)
        return jnp.mean(logits.astype(jnp.float32)) + aux.load_balancing_loss

    made = stacks(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)
    experts = [tuple(v.shape) for path, v in nnx.to_flat_state(state) if path[-1] in ("w_gate_up", "w_down")]
    assert experts
    for shape in experts:  # once: the weight's gradient, in the compute dtype
        assert made.count((shape, jnp.dtype(jnp.bfloat16))) == 1, (shape, made)
        assert [s for s, _ in made].count(shape) == 1, (shape, made)


@pytest.mark.parametrize("remat", [False, True])
def test_prepare_runs_per_layer_and_stacks_its_dtype(remat):
    # prepare = a cast to bf16: values and gradients equal jax.lax.scan with the cast inside the layer, the
    # parameters' gradients stack in bf16 (converted once after the loop), and no cast copy is stacked.
    def cast(p):
        return jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)

    def bf16_layer(params, c, consts):
        h = jnp.tanh(c.astype(jnp.bfloat16) @ params["w"] + params["b"]).astype(jnp.float32) * consts[0]
        return c + h, {"energy": jnp.sum(h**2), "positive": jnp.sum(h > 0).astype(jnp.int32)}

    fn = jax.checkpoint(bf16_layer, policy=jax.checkpoint_policies.nothing_saveable) if remat else bf16_layer
    args = problem(1)
    grad = jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True)
    ours = functools.partial(layer_scan.scan, prepare=cast)
    (value, _), grads = jax.jit(grad, static_argnums=(0, 1))(ours, fn, *args)
    cast_inside = lambda p, c, k: fn(cast(p), c, k)  # noqa: E731
    (ref_value, _), ref_grads = jax.jit(grad, static_argnums=(0, 1))(reference, cast_inside, *args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for got, want, param in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), jax.tree.leaves(args), strict=True):
        assert got.dtype == param.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    params, x, consts = args
    made = stacks(jax.make_jaxpr(lambda p: grad(ours, fn, p, x, consts))(params).jaxpr)
    assert made.count(((L, H, H), jnp.dtype(jnp.bfloat16))) == 1  # w's gradient, no cast copy of w
    assert ((L, H, H), jnp.dtype(jnp.float32)) not in made


def viewed_layer(view):
    # h * scale keeps h and h' * c' keeps both, where ' is a view: none, [B, 2, H/2], or an optimisation
    # barrier (as a kernel's residuals pass one); c @ w keeps c.
    views = {
        "none": lambda a: a,
        "reshape": lambda a: a.reshape(B, 2, H // 2),
        "barrier": jax.lax.optimization_barrier,
    }

    def fn(params, c, consts):
        h = jnp.tanh(c @ params["w"] + params["b"])
        s = (views[view](h) * views[view](c)).reshape(B, H)
        return c + h * consts[0] + s, {"energy": jnp.sum(h**2), "positive": jnp.sum(h > 0).astype(jnp.int32)}

    return fn


@pytest.mark.parametrize("view", ["reshape", "barrier"])
def test_a_view_of_a_residual_is_not_stacked_again(view):
    # The backward rebuilds the view from h's slice: the stacks are those of the layer without the view.
    args = problem(2)
    grad = jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True)
    (value, _), grads = jax.jit(grad, static_argnums=(0, 1))(layer_scan.scan, viewed_layer(view), *args)
    (ref_value, _), ref_grads = jax.jit(grad, static_argnums=(0, 1))(reference, viewed_layer(view), *args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    params, x, consts = args

    def made(fn):
        return stack_shapes(jax.make_jaxpr(lambda p: grad(layer_scan.scan, fn, p, x, consts))(params).jaxpr)

    assert sorted(made(viewed_layer(view))) == sorted(made(viewed_layer("none")))


def test_stacks_of_different_lengths_are_refused():
    params = {"w": jnp.zeros((2, H, H)), "b": jnp.zeros((3, H))}
    with pytest.raises(ValueError, match="one leading length"):
        layer_scan.scan(layer, params, jnp.zeros((B, H)), (jnp.ones(H),))
