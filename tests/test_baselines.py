"""The pure-JAX peer (`jax_megamoe.baselines`: sort + grouped matmuls) computes moe_ffn's function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from moe_cases import Case, make_problem, rel_error

from jax_megamoe import reference
from jax_megamoe.baselines import ragged_dot_moe_ffn


@pytest.mark.parametrize("case", [Case(24, 16, 8, 6, 2, "zipf"), Case(10, 16, 8, 6, 2, "out_of_range")], ids=str)
def test_matches_reference_forward_and_gradients(case):
    (x, weights, experts, w_gate_up, w_down), cotangent = make_problem(case, jnp.float32, seed="ragged_dot")

    def loss(fn, x, weights, w_gate_up, w_down):
        return jnp.sum(fn(x, weights, experts, w_gate_up, w_down) * cotangent)

    args = (x, weights, w_gate_up, w_down)
    got = jax.value_and_grad(lambda *a: loss(ragged_dot_moe_ffn, *a), argnums=(0, 1, 2, 3))(*args)
    want = jax.value_and_grad(lambda *a: loss(reference.moe_ffn, *a), argnums=(0, 1, 2, 3))(*args)
    assert rel_error(got[0], want[0]) <= 1e-5
    for name, g, w in zip(("x", "weights", "w_gate_up", "w_down"), got[1], want[1], strict=True):
        assert rel_error(g, w) <= 1e-5, name
