"""moe_ffn on the CPU kernels against the pure-JAX reference: forward, gradients, edge cases, transforms."""

from __future__ import annotations

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_megamoe as jmm
from jax_megamoe import reference
from jax_megamoe.ops import moe as moe_ops
from jax_megamoe.ops.moe import moe_layout
from moe_cases import TOLERANCE, Case, make_problem, rel_error, seeded_rng

EDGE_CASES = [
    Case(16, 24, 12, 8, 2),
    Case(16, 24, 12, 8, 2, "zipf"),
    Case(1, 16, 8, 4, 2),             # T = 1
    Case(12, 16, 8, 6, 1),            # K = 1
    Case(7, 16, 8, 4, 4),             # K = E
    Case(9, 16, 8, 1, 1),             # E = 1
    Case(20, 16, 8, 8, 2, "empty_experts"),
    Case(15, 16, 8, 5, 1, "one_expert"),
    Case(11, 13, 7, 5, 3),            # H, I not multiples of 8
    Case(10, 16, 8, 6, 2, "out_of_range"),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _upcast(args):
    x, weights, experts, w_gate_up, w_down = args
    return x.astype(jnp.float32), weights, experts, w_gate_up.astype(jnp.float32), w_down.astype(jnp.float32)


def _loss_grads(fn, args, cotangent):
    """Gradients of <fn(...), cotangent> in x, weights, w_gate_up, w_down."""
    x, weights, experts, w_gate_up, w_down = args

    def loss(x, weights, w_gate_up, w_down):
        y = fn(x, weights, experts, w_gate_up, w_down)
        return jnp.sum(y.astype(jnp.float32) * cotangent)

    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, weights, w_gate_up, w_down)


def _cpu(*args):
    return jmm.moe_ffn(*args, backend="cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_forward_matches_reference(case, dtype):
    rng = seeded_rng(str(case), jnp.dtype(dtype).name)
    args = make_problem(rng, case, dtype)
    y = _cpu(*args)
    assert y.shape == (case.tokens, case.hidden) and y.dtype == dtype
    expected = reference.moe_ffn(*_upcast(args))
    assert rel_error(y, expected) <= TOLERANCE[jnp.dtype(dtype).name]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_gradients_match_reference(case, dtype):
    rng = seeded_rng(str(case), jnp.dtype(dtype).name, "grad")
    args = make_problem(rng, case, dtype)
    cotangent = jnp.asarray(rng.standard_normal((case.tokens, case.hidden)), jnp.float32)
    grads = _loss_grads(_cpu, args, cotangent)
    expected = _loss_grads(reference.moe_ffn, _upcast(args), cotangent)
    tol = TOLERANCE[jnp.dtype(dtype).name]
    for name, got, want, primal in zip(("x", "weights", "w_gate_up", "w_down"), grads, expected,
                                       (args[0], args[1], args[3], args[4])):
        assert got.shape == primal.shape and got.dtype == primal.dtype, name
        assert rel_error(got, want) <= 2 * tol, name


def test_dropped_pairs_get_zero_gradient():
    rng = np.random.default_rng(0)
    case = Case(10, 16, 8, 6, 2, "out_of_range")
    args = make_problem(rng, case, jnp.float32)
    cotangent = jnp.ones((case.tokens, case.hidden), jnp.float32)
    d_weights = _loss_grads(_cpu, args, cotangent)[1]
    dropped = (np.asarray(args[2]) < 0) | (np.asarray(args[2]) >= case.experts)
    assert dropped.any()
    np.testing.assert_array_equal(np.asarray(d_weights)[dropped], 0.0)


@pytest.mark.parametrize("case", [Case(5, 6, 3, 3, 2), Case(4, 5, 4, 2, 1, "out_of_range")], ids=str)
def test_check_grads_float64(case):
    with jax.enable_x64(True):
        args = make_problem(np.random.default_rng(1), case, jnp.float64)
        x, weights, experts, w_gate_up, w_down = args
        weights = weights.astype(jnp.float64)

        def fn(x, weights, w_gate_up, w_down):
            return jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, backend="cpu")

        jax.test_util.check_grads(fn, (x, weights, w_gate_up, w_down), order=1, modes=("rev",),
                                  atol=1e-7, rtol=1e-7)
        y = fn(x, weights, w_gate_up, w_down)
        assert rel_error(y, reference.moe_ffn(x, weights, experts, w_gate_up, w_down)) <= TOLERANCE["float64"]


def test_layout_is_stable_sort_by_expert():
    experts = np.array([[2, 0], [1, 2], [0, 9], [2, -1]], np.int32)
    layout = moe_layout(jnp.asarray(experts), 4, "cpu")
    np.testing.assert_array_equal(layout.expert_offsets, [0, 2, 3, 6, 6])
    np.testing.assert_array_equal(layout.pair_of_row, [1, 4, 2, 0, 3, 6, -1, -1])
    np.testing.assert_array_equal(layout.row_of_pair, [3, 0, 2, 4, 1, -1, 5, -1])


def test_deterministic_bitwise():
    args = make_problem(np.random.default_rng(2), Case(32, 24, 12, 8, 4, "zipf"), jnp.bfloat16)
    cotangent = jnp.asarray(np.random.default_rng(3).standard_normal((32, 24)), jnp.float32)
    first = (_cpu(*args), *_loss_grads(_cpu, args, cotangent))
    second = (_cpu(*args), *_loss_grads(_cpu, args, cotangent))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_jit_and_checkpoint_match_eager():
    case = Case(16, 16, 8, 4, 2)
    args = make_problem(np.random.default_rng(4), case, jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(5).standard_normal((16, 16)), jnp.float32)
    eager = _loss_grads(_cpu, args, cotangent)
    jitted = jax.jit(lambda *a: _loss_grads(_cpu, a, cotangent))(*args)
    remat = jax.jit(lambda *a: _loss_grads(jax.checkpoint(_cpu), a, cotangent))(*args)
    for e, j, r in zip(eager, jitted, remat):
        np.testing.assert_allclose(j, e, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r, e, rtol=1e-6, atol=1e-6)


def test_checkpointed_backward_recomputes_only_the_gate_up_call():
    # A training step under jax.checkpoint: y goes on (returned), the backward recomputes the forward. Only
    # moe_gate_up is recomputed (the backward needs gate_up alone): JAX drops the recomputed moe_down. Counted in
    # the lowered program: XLA's CPU compiler then merges the recomputation with the forward (it drops the
    # optimisation barrier), its GPU compiler keeps both (benchmarks/RESULTS.md times them).
    case = Case(16, 16, 8, 4, 2)
    x, weights, experts, w_gate_up, w_down = make_problem(np.random.default_rng(7), case, jnp.float32)
    cotangent = jnp.ones((16, 16), jnp.float32)

    def calls(fn):
        def step(x, weights, w_gate_up, w_down):
            y, vjp = jax.vjp(lambda a, b, c, d: fn(a, b, experts, c, d), x, weights, w_gate_up, w_down)
            return y, vjp(cotangent)
        text = jax.jit(step).lower(x, weights, w_gate_up, w_down).as_text()
        return {op: text.count(f"custom_call @jmm_cpu_moe_{op}(") for op in ("gate_up", "down", "backward")}

    assert calls(_cpu) == {"gate_up": 1, "down": 1, "backward": 1}
    assert calls(jax.checkpoint(_cpu)) == {"gate_up": 2, "down": 1, "backward": 1}


def test_checkpoint_policy_saving_the_named_residuals_recomputes_nothing():
    # save_only_these_names("moe_layout", "moe_gate_up"): the backward takes the saved layout and projections, so
    # the program runs each MoE call once, and the gradients are those of the plain call.
    case = Case(16, 16, 8, 4, 2, "zipf")
    x, weights, experts, w_gate_up, w_down = make_problem(np.random.default_rng(8), case, jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(9).standard_normal((16, 16)), jnp.float32)
    policy = jax.checkpoint_policies.save_only_these_names(moe_ops.LAYOUT_NAME, moe_ops.GATE_UP_NAME)

    def step(fn):
        def run(x, weights, w_gate_up, w_down):
            y, vjp = jax.vjp(lambda a, b, c, d: fn(a, b, experts, c, d), x, weights, w_gate_up, w_down)
            return y, vjp(cotangent)
        return jax.jit(run)

    saved = step(jax.checkpoint(_cpu, policy=policy))
    text = saved.lower(x, weights, w_gate_up, w_down).as_text()
    assert {op: text.count(f"custom_call @jmm_cpu_moe_{op}(") for op in ("layout", "gate_up", "down", "backward")} \
        == {"layout": 1, "gate_up": 1, "down": 1, "backward": 1}
    for got, want in zip(jax.tree.leaves(saved(x, weights, w_gate_up, w_down)),
                         jax.tree.leaves(step(_cpu)(x, weights, w_gate_up, w_down)), strict=True):
        np.testing.assert_array_equal(got, want)


def test_inside_shard_map_each_device_runs_local_op():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    case = Case(8 * 6, 16, 8, 4, 2)
    x, weights, experts, w_gate_up, w_down = make_problem(np.random.default_rng(6), case, jnp.float32)

    def local(x, weights, experts, w_gate_up, w_down):
        return jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, backend="cpu")

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P(), P()),
                                    out_specs=P("data")))

    def loss(fn, x, w_gate_up):
        return jnp.sum(fn(x, weights, experts, w_gate_up, w_down) ** 2)

    y = sharded(x, weights, experts, w_gate_up, w_down)
    assert rel_error(y, reference.moe_ffn(x, weights, experts, w_gate_up, w_down)) <= 1e-5
    g = jax.grad(lambda x, w: loss(sharded, x, w), argnums=(0, 1))(x, w_gate_up)
    g_ref = jax.grad(lambda x, w: loss(reference.moe_ffn, x, w), argnums=(0, 1))(x, w_gate_up)
    for a, b in zip(g, g_ref):
        assert rel_error(a, b) <= 1e-5


def test_auto_backend_on_cpu_uses_kernels():
    from jax_megamoe.ops.moe import resolve_backend
    assert resolve_backend("auto") == "cpu"
    assert resolve_backend("reference") == "reference"
    with pytest.raises(ValueError, match="backend='cuda'"):
        resolve_backend("cuda")
