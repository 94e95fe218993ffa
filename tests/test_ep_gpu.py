"""moe_ffn_ep on GPUs (marker `gpu`): one expert shard on one GPU against moe_ffn, and the ragged transport.

With one shard nothing crosses devices, so `moe_ffn_ep` must give moe_ffn's bits exactly (forward and
all gradients). The multi-shard path (with the real `ragged_all_to_all`) also runs on a one-GPU axis. Every
check also compares against the float32 reference (float32: normwise relative error <= 1e-5, 3e-4 if the
kernels use tf32-class math; bf16: <= 1e-2) and rejects non-finite values.
Tests that need two GPUs run only where there are two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from moe_cases import Case, reference_value_and_grads, rel_error, value_and_grads
from moe_cases import make_problem as make_moe_problem

import jax_megamoe as jmm
from jax_megamoe.parallel import transport
from jax_megamoe.parallel.plan import make_plan

pytestmark = pytest.mark.gpu

TOLERANCE = {jnp.float32: 3e-4, jnp.bfloat16: 1e-2}


def make_problem(seed, tokens, hidden, inter, experts, top_k, dtype, routing="uniform"):
    """Fresh inputs: distinct experts per token, uniform or Zipf-skewed (p_e ~ 1/(e+1)^1.2)."""
    return make_moe_problem(Case(tokens, hidden, inter, experts, top_k, routing), dtype, seed=("ep gpu", seed))


def ep_function(devices, **options):
    mesh = Mesh(np.array(devices), ("expert",))
    spec = P("expert")
    return jax.shard_map(functools.partial(jmm.moe_ffn_ep, **options), mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)


def assert_close_to_reference(results, args, dy, dtype):
    expected = reference_value_and_grads(args, dy)
    for name, got, want in zip(("y", "dx", "d_weights", "d_w_gate_up", "d_w_down"), results, expected, strict=True):
        err = rel_error(got, want)
        assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.2e} > {TOLERANCE[dtype]}"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("routing", ["uniform", "zipf"])
def test_one_gpu_equals_moe_ffn(gpus, dtype, routing):
    args, dy = make_problem(7, 2048, 512, 256, 32, 4, dtype, routing)
    ep = jax.jit(functools.partial(value_and_grads, ep_function(gpus[:1])))(args, dy)
    single = jax.jit(functools.partial(value_and_grads, jmm.moe_ffn))(args, dy)
    for name, a, b in zip(("y", "dx", "d_weights", "d_w_gate_up", "d_w_down"), ep, single, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert_close_to_reference(ep, args, dy, dtype)


def test_one_gpu_deterministic_and_capacity_counted(gpus):
    args, dy = make_problem(11, 1024, 256, 128, 16, 4, jnp.bfloat16, "zipf")

    def with_stats(*a):
        y, stats = jmm.moe_ffn_ep(*a, capacity_factor=0.5, return_stats=True)
        return y, stats.expert_counts, stats.pairs_dropped[None]

    spec = P("expert")
    fn = jax.jit(
        jax.shard_map(
            with_stats, mesh=Mesh(np.array(gpus[:1]), ("expert",)), in_specs=(spec,) * 5, out_specs=(spec, spec, spec)
        )
    )
    first, second = fn(*args), fn(*args)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # One shard, capacity 0.5 * T * K pairs kept in (token, k) order.
    capacity = 1024 * 4 // 2
    flat_ids = np.asarray(args[2]).reshape(-1)
    np.testing.assert_array_equal(np.asarray(first[1]), np.bincount(flat_ids[:capacity], minlength=16))
    assert int(first[2][0]) == flat_ids.size - capacity


def test_ragged_all_to_all_is_usable_here():
    assert transport.ragged_supported(), "jax.lax.ragged_all_to_all failed its one-GPU probe"


@pytest.mark.parametrize("transport_name", ["xla", "ragged"])
def test_exchange_path_on_one_gpu(gpus, transport_name):
    """The multi-shard path (plan, row gather, the transport's exchanges, local kernels on padded rows, combine:
    `Transport.experts`), run on a one-GPU axis: moe_ffn_ep takes a shortcut at ep=1, so this is where one GPU
    exercises it, and the real ragged_all_to_all with its transpose."""
    tokens, experts, top_k = 1024, 16, 4
    args, dy = make_problem(17, tokens, 256, 128, experts, top_k, jnp.bfloat16, "zipf")

    def exchange_path(x, weights, ids, w_gate_up, w_down):
        plan = make_plan(ids, 1, experts, tokens * top_k, tokens)
        return transport.resolve_transport(transport_name).experts(
            x, weights, plan, w_gate_up, w_down, axis_name="expert", implementation="auto"
        )

    spec = P("expert")
    fn = jax.shard_map(exchange_path, mesh=Mesh(np.array(gpus[:1]), ("expert",)), in_specs=(spec,) * 5, out_specs=spec)
    assert_close_to_reference(jax.jit(functools.partial(value_and_grads, fn))(args, dy), args, dy, jnp.bfloat16)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("transport_name", ["xla", "ragged"])
def test_two_gpus_match_reference(gpus, transport_name):
    args, dy = make_problem(13, 2048, 512, 256, 32, 4, jnp.bfloat16, "zipf")
    fn = jax.jit(functools.partial(value_and_grads, ep_function(gpus[:2], transport=transport_name)))
    first, second = fn(args, dy), fn(args, dy)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_close_to_reference(first, args, dy, jnp.bfloat16)
