"""route, the auxiliary losses and their Qwen3-MoE / Switch semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import seeded_rng

import jax_megamoe as jmm
from jax_megamoe import reference


def _numpy_route(logits, top_k, norm):
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, -1)
    if norm:
        weights /= weights.sum(-1, keepdims=True)
    return weights, experts


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_route_matches_numpy(top_k, norm):
    logits = seeded_rng(top_k, norm).standard_normal((33, 8)).astype(np.float32)
    weights, experts = jmm.route(jnp.asarray(logits), top_k, norm_topk_prob=norm)
    want_w, want_e = _numpy_route(logits.astype(np.float64), top_k, norm)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
    np.testing.assert_array_equal(experts, want_e)
    np.testing.assert_allclose(weights, want_w, rtol=1e-6, atol=1e-7)


def test_route_ties_go_to_lower_expert_id():
    logits = jnp.zeros((2, 6), jnp.bfloat16)
    weights, experts = jmm.route(logits, 3)
    np.testing.assert_array_equal(experts, [[0, 1, 2], [0, 1, 2]])
    np.testing.assert_allclose(weights, 1 / 3, rtol=1e-6)


def test_normalised_weights_equal_softmax_of_selected_logits():
    logits = jnp.asarray(seeded_rng("softmax").standard_normal((16, 10)), jnp.float32)
    weights, experts = jmm.route(logits, 4)
    expected = jax.nn.softmax(jnp.take_along_axis(logits, experts, -1), axis=-1)
    np.testing.assert_allclose(weights, expected, rtol=1e-5)


def _numpy_route_gradient(logits, coeff, top_k, norm):
    """d/d logits of sum(route(logits)[0] * coeff), in float64 by hand: with renormalisation the weights are the
    softmax of the selected logits, g_i = w_i (c_i - sum_j w_j c_j) on the selected and 0 elsewhere; without,
    they are the full softmax's selected entries, g_i = p_i (c_i [i selected] - sum_selected p_j c_j)."""
    weights, experts = _numpy_route(logits, top_k, norm)
    grad = np.zeros_like(logits)
    rows = np.arange(logits.shape[0])[:, None]
    if norm:
        grad[rows, experts] = weights * (coeff - np.sum(weights * coeff, -1, keepdims=True))
    else:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        grad = -probs * np.sum(weights * coeff, -1, keepdims=True)
        grad[rows, experts] += weights * coeff
    return grad


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_route_gradient_matches_the_reference(top_k, norm):
    """The weights' gradient in the logits: jax.grad of jmm.route equals jax.grad of reference.route and the
    gradient written out by hand in float64 (zero for the experts not selected)."""
    rng = seeded_rng("route grad", top_k, norm)
    logits = rng.standard_normal((8, 6)).astype(np.float32)
    coeff = rng.standard_normal((8, top_k)).astype(np.float32)

    def loss(route):
        return lambda l: jnp.sum(route(l, top_k, norm)[0] * coeff)

    grad = jax.grad(loss(jmm.route))(jnp.asarray(logits))
    np.testing.assert_allclose(grad, jax.grad(loss(reference.route))(jnp.asarray(logits)), rtol=1e-6, atol=1e-7)
    want = _numpy_route_gradient(logits.astype(np.float64), coeff.astype(np.float64), top_k, norm)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)
    if not (top_k == 1 and norm):  # one renormalised weight is always 1: no gradient (but rounding) then
        assert float(jnp.abs(grad).sum()) > 0


def test_load_balancing_loss_is_top_k_at_perfect_balance():
    num_experts, top_k = 8, 2
    logits = jnp.zeros((num_experts, num_experts))
    experts = jnp.stack([jnp.arange(num_experts), (jnp.arange(num_experts) + 1) % num_experts], axis=1)
    np.testing.assert_allclose(jmm.load_balancing_loss(logits, experts), top_k, rtol=1e-6)


def test_load_balancing_loss_matches_formula():
    rng = seeded_rng("aux")
    logits = rng.standard_normal((20, 6)).astype(np.float32)
    _, experts = _numpy_route(logits.astype(np.float64), 2, True)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    counts = np.bincount(experts.reshape(-1), minlength=6)
    expected = 6 * np.sum(counts / 20 * probs.mean(0))
    got = jmm.load_balancing_loss(jnp.asarray(logits), jnp.asarray(experts, jnp.int32))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_router_z_loss():
    logits = seeded_rng("z").standard_normal((12, 5)).astype(np.float32)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(jmm.router_z_loss(jnp.asarray(logits)), np.mean(lse**2), rtol=1e-5)


@pytest.mark.parametrize(
    "logits, top_k, error, match",
    [
        (np.zeros((4,)), 1, ValueError, "router_logits must have rank 2"),
        (np.zeros((4, 3), np.int32), 1, TypeError, "router_logits must be a floating dtype"),
        (np.zeros((4, 3)), 4, ValueError, r"top_k must be in \[1, E=3\], got 4"),
        (np.zeros((4, 3)), 0, ValueError, "top_k must be in"),
        (np.zeros((4, 3)), 1.0, TypeError, "top_k must be a Python int"),
    ],
)
def test_route_bad_inputs(logits, top_k, error, match):
    with pytest.raises(error, match=match):
        jmm.route(jnp.asarray(logits), top_k)
