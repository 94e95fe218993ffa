"""moe_ffn on the CPU kernels beyond parity (parity with the reference: tests/test_parity.py): the expert
layout, what jax.checkpoint recomputes (counted in the lowered program), shard_map, and "auto"."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from moe_cases import Case, make_problem, rel_error, value_and_grads

import jax_megamoe as jmm
from jax_megamoe import reference
from jax_megamoe.ops import moe as moe_ops
from jax_megamoe.ops.layout import moe_layout

_cpu = functools.partial(jmm.moe_ffn, implementation="cpu")


def test_layout_is_stable_sort_by_expert():
    experts = np.array([[2, 0], [1, 2], [0, 9], [2, -1]], np.int32)
    layout = moe_layout(jnp.asarray(experts), 4, "cpu")
    np.testing.assert_array_equal(layout.expert_offsets, [0, 2, 3, 6, 6])
    np.testing.assert_array_equal(layout.pair_of_row, [1, 4, 2, 0, 3, 6, -1, -1])
    np.testing.assert_array_equal(layout.row_of_pair, [3, 0, 2, 4, 1, -1, 5, -1])


def test_checkpointed_backward_recomputes_only_the_gate_up_call():
    # A training step under jax.checkpoint: y goes on (returned), the backward recomputes the forward. Only
    # moe_gate_up is recomputed (the backward needs gate_up alone): JAX drops the recomputed moe_down. Counted in
    # the lowered program: XLA's CPU compiler then merges the recomputation with the forward (it drops the
    # optimisation barrier), its GPU compiler keeps both (benchmarks/bench_moe.py's remat variant times them).
    case = Case(16, 16, 8, 4, 2)
    (x, weights, experts, w_gate_up, w_down), _ = make_problem(case, jnp.float32, seed="remat counts")
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
    (x, weights, experts, w_gate_up, w_down), cotangent = make_problem(case, jnp.float32, seed="policy")
    policy = jax.checkpoint_policies.save_only_these_names(moe_ops.LAYOUT_NAME, moe_ops.GATE_UP_NAME)

    def step(fn):
        def run(x, weights, w_gate_up, w_down):
            y, vjp = jax.vjp(lambda a, b, c, d: fn(a, b, experts, c, d), x, weights, w_gate_up, w_down)
            return y, vjp(cotangent)

        return jax.jit(run)

    saved = step(jax.checkpoint(_cpu, policy=policy))
    text = saved.lower(x, weights, w_gate_up, w_down).as_text()
    assert {op: text.count(f"custom_call @jmm_cpu_moe_{op}(") for op in ("layout", "gate_up", "down", "backward")} == {
        "layout": 1,
        "gate_up": 1,
        "down": 1,
        "backward": 1,
    }
    for got, want in zip(
        jax.tree.leaves(saved(x, weights, w_gate_up, w_down)),
        jax.tree.leaves(step(_cpu)(x, weights, w_gate_up, w_down)),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)


def test_inside_shard_map_each_device_runs_local_op():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    case = Case(8 * 6, 16, 8, 4, 2)
    (x, weights, experts, w_gate_up, w_down), _ = make_problem(case, jnp.float32, seed="shard_map")

    def local(x, weights, experts, w_gate_up, w_down):
        return jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, implementation="cpu")

    sharded = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P(), P()), out_specs=P("data"))
    )

    def loss(fn, x, w_gate_up):
        return jnp.sum(fn(x, weights, experts, w_gate_up, w_down) ** 2)

    y = sharded(x, weights, experts, w_gate_up, w_down)
    assert rel_error(y, reference.moe_ffn(x, weights, experts, w_gate_up, w_down)) <= 1e-5
    g = jax.grad(lambda x, w: loss(sharded, x, w), argnums=(0, 1))(x, w_gate_up)
    g_ref = jax.grad(lambda x, w: loss(reference.moe_ffn, x, w), argnums=(0, 1))(x, w_gate_up)
    for a, b in zip(g, g_ref, strict=True):
        assert rel_error(a, b) <= 1e-5


def test_auto_on_cpu_uses_the_cpu_kernels():
    from jax_megamoe.ops.moe import resolve_implementation

    assert resolve_implementation("auto") == "cpu"
    assert resolve_implementation("reference") == "reference"
    with pytest.raises(ValueError, match="implementation='cuda'"):
        resolve_implementation("cuda")
    args, dy = make_problem(Case(16, 16, 8, 4, 2), jnp.float32, seed="auto")
    text = jax.jit(functools.partial(value_and_grads, jmm.moe_ffn)).lower(args, dy).as_text()
    assert all(f"@jmm_cpu_moe_{op}(" in text for op in ("layout", "gate_up", "down", "backward"))
    for a, b in zip(value_and_grads(jmm.moe_ffn, args, dy), value_and_grads(_cpu, args, dy), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cuda_kernels_on_a_cpu_backend_name_the_platform_as_a_word(monkeypatch):
    """A build with the CUDA kernels on a machine without GPUs: the error names the platform found, as a word."""
    from jax_megamoe import _ffi
    from jax_megamoe.ops.moe import resolve_implementation

    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)
    with pytest.raises(ValueError) as err:
        resolve_implementation("cuda")
    assert str(err.value) == (
        "implementation='cuda' runs on gpu devices, but jax.default_backend() is 'cpu': use implementation='auto' "
        "or the one for that platform"
    )
    with pytest.raises(ValueError, match="but the arrays live on cpu devices: use implementation='auto'"):
        resolve_implementation("cuda", [jnp.zeros(2)])
