"""moe_ffn_ep under jax.shard_map on 8 host CPU devices, against the single-device reference: the shared checks of
every transport (tests/transport_cases.py) for "xla" and for "ragged" with its collective emulated, and the
options, ids, shardings and transforms around them."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from moe_cases import (
    OUTPUT_NAMES,
    Case,
    make_routing,
    merge_shards,
    rel_error,
    seeded_rng,
    split_shards,
    without_dropped,
)
from moe_cases import make_problem as make_moe_problem
from transport_cases import ROUTINGS, EpCase, TransportBase, parametrize_cases

import jax_megamoe as jmm
from jax_megamoe import reference
from jax_megamoe.parallel import EPStats, moe_ffn_ep, transport

# One gathered problem size for every mesh, so each jitted function compiles once per mesh (CI has 2 cores).
TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 64, 16, 8, 16, 4
MESHES = {  # name -> (shape, axis names); tokens are sharded over every axis, experts over "expert"
    "ep1": ((1,), ("expert",)),
    "ep2": ((2,), ("expert",)),
    "ep4": ((4,), ("expert",)),  # K == E_local
    "ep8": ((8,), ("expert",)),  # K > E_local: rows carry per-local-expert summed weights
    "data2xep4": ((2, 4), ("data", "expert")),
}


def make_mesh(name: str) -> Mesh:
    shape, names = MESHES[name]
    return Mesh(np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names)


def make_problem(seed, tokens: int, routing: str, dtype=jnp.float32):
    """The gathered problem `(x, weights, experts, w_gate_up, w_down)` plus a float32 cotangent for `y`."""
    args, dy = make_moe_problem(Case(tokens, HIDDEN, INTER, EXPERTS, TOP_K, routing), dtype, seed=seed)
    return args, dy.astype(jnp.float32)


def ep_function(mesh: Mesh, **options):
    """`moe_ffn_ep` under shard_map: tokens sharded over all mesh axes, experts over "expert"."""
    tokens, experts = P(mesh.axis_names), P("expert")

    def body(*args):
        return moe_ffn_ep(*args, **options)

    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts), out_specs=tokens)


def value_and_grads(fn, args, dy):
    """`fn(*args)` and the gradients of `<fn(*args), dy>` in x, weights, w_gate_up, w_down."""

    def loss(x, weights, w_gate_up, w_down):
        y = fn(x, weights, args[2], w_gate_up, w_down)
        return jnp.sum(y.astype(jnp.float32) * dy), y

    grads, y = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(args[0], args[1], args[3], args[4])
    return y, grads


@functools.cache
def jitted_value_and_grads(fn):
    return jax.jit(functools.partial(value_and_grads, fn))


@functools.cache
def ep_value_and_grads(mesh_name: str, **options):
    """Jitted forward and gradients of `moe_ffn_ep` on a named mesh, compiled once per options."""
    return jitted_value_and_grads(ep_function(make_mesh(mesh_name), **options))


def assert_matches_reference(value_and_grads_fn, args, dy, tol=1e-5, reference_args=None):
    """Forward and all four gradients against the reference on `reference_args` (default `args`)."""
    reference_args = args if reference_args is None else reference_args
    y, grads = value_and_grads_fn(args, dy)
    y_ref, grads_ref = jitted_value_and_grads(reference.moe_ffn)(reference_args, dy)
    for name, got, want in zip(
        ("y", "dx", "d_weights", "d_w_gate_up", "d_w_down"), (y, *grads), (y_ref, *grads_ref), strict=True
    ):
        assert got.shape == want.shape, name
        assert rel_error(got, want) <= tol, f"{name}: relative error {rel_error(got, want):.2e} > {tol}"


@pytest.mark.parametrize("mesh_name", ["ep2", "ep8"])
def test_repeated_and_out_of_range_ids(mesh_name):
    """Repeated ids in a token's top-k count twice; ids outside [0, E) contribute zero (as in moe_ffn)."""
    (x, weights, ids, w_gate_up, w_down), dy = make_problem(mesh_name, TOKENS, "uniform")
    ids = ids.at[0, 1].set(ids[0, 0]).at[1, :].set(ids[1, 0]).at[2, 0].set(-1).at[3, 2].set(EXPERTS)
    ids = ids.at[4, :].set(jnp.array([2**30, -(2**30), EXPERTS + 3, -5]))
    assert_matches_reference(ep_value_and_grads(mesh_name, transport="xla"), (x, weights, ids, w_gate_up, w_down), dy)


@pytest.mark.parametrize("mesh_name", ["ep2", "data2xep4"])
def test_int64_ids_outside_the_range_are_dropped(mesh_name):
    """With jax_enable_x64, int64 ids of 2**32 + 1, -2**32 + 1 and E (an int32 cast would make the first two
    expert 1) are dropped by the xla transport: bit for bit the problem with those pairs given id -1."""
    with jax.enable_x64(True):
        (x, weights, ids, w_gate_up, w_down), dy = make_problem(("int64", mesh_name), TOKENS, "uniform")
        wide = np.asarray(ids).astype(np.int64)
        wide[0, 0], wide[9, 1], wide[17, :], wide[40, 3] = 2**32 + 1, -(2**32) + 1, EXPERTS, 2**40
        fn = jitted_value_and_grads(ep_function(make_mesh(mesh_name), transport="xla"))
        got = fn((x, weights, jnp.asarray(wide, jnp.int64), w_gate_up, w_down), dy)
        want = fn((x, weights, without_dropped(wide, EXPERTS), w_gate_up, w_down), dy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(got[0])[17] == 0)


def test_one_shard_is_bitwise_moe_ffn():
    """With one expert shard nothing moves: same rows, same kernels, same bits as moe_ffn."""
    args, dy = make_problem("ep1 bitwise", TOKENS, "zipf")
    got = ep_value_and_grads("ep1")(args, dy)
    want = jitted_value_and_grads(jmm.moe_ffn)(args, dy)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_close_to_float32_reference():
    args, dy = make_problem("bf16", TOKENS, "zipf", dtype=jnp.bfloat16)
    args32 = tuple(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args)
    assert_matches_reference(ep_value_and_grads("data2xep4"), args, dy, tol=1e-2, reference_args=args32)


def test_bitwise_deterministic():
    args, dy = make_problem("determinism", TOKENS, "zipf")
    first = ep_value_and_grads("ep8")(args, dy)
    fresh = jax.jit(functools.partial(value_and_grads, ep_function(make_mesh("ep8"))))  # a fresh trace and compile
    for again in (ep_value_and_grads("ep8")(args, dy), fresh(args, dy)):
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def check_named_sharding(mesh: Mesh):
    args, dy = make_problem("named", TOKENS, "uniform")
    specs = (P(mesh.axis_names),) * 3 + (P("expert"),) * 2
    sharded = tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs, strict=True))
    dy_sharded = jax.device_put(dy, NamedSharding(mesh, P(mesh.axis_names)))
    fn = jitted_value_and_grads(ep_function(mesh))
    y, grads = fn(sharded, dy_sharded)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(mesh.axis_names)), y.ndim)
    assert grads[2].sharding.is_equivalent_to(NamedSharding(mesh, P("expert")), 3)  # weight grads stay sharded
    assert_matches_reference(fn, sharded, dy, reference_args=args)  # the reference on unsharded inputs


def test_jit_with_named_sharding_inputs():
    check_named_sharding(make_mesh("data2xep4"))


def test_jit_with_explicit_axes_mesh():
    """`jax.make_mesh` gives Explicit axes by default; jit then runs under `jax.set_mesh`."""
    mesh = jax.make_mesh(*MESHES["data2xep4"])
    with jax.set_mesh(mesh):
        check_named_sharding(mesh)


def test_under_checkpoint():
    args, dy = make_problem("remat", TOKENS, "zipf")
    outside = jitted_value_and_grads(jax.checkpoint(ep_function(make_mesh("data2xep4"))))
    assert_matches_reference(outside, args, dy)
    tokens, experts = P("expert"), P("expert")
    inside = jax.shard_map(
        jax.checkpoint(lambda *a: moe_ffn_ep(*a)),
        mesh=make_mesh("ep4"),
        in_specs=(tokens,) * 3 + (experts,) * 2,
        out_specs=tokens,
    )
    assert_matches_reference(jitted_value_and_grads(inside), args, dy)


@pytest.mark.parametrize("mesh_name, routing", [("ep2", "zipf"), ("ep8", "all_to_one"), ("data2xep4", "empty_experts")])
def test_public_export_and_stats_are_the_counted_values(mesh_name, routing):
    """`return_stats=True` gives an EPStats of per-shard int32 arrays: `expert_counts [E_local]` (the pairs each
    local expert computed), `pairs_received` and `pairs_dropped` (scalars), equal to the numpy count of the
    routing (dropless: nothing dropped; every routed pair received by the shard of its expert)."""
    assert jmm.moe_ffn_ep is moe_ffn_ep and jmm.EPStats is EPStats
    mesh = make_mesh(mesh_name)
    args, _ = make_problem(("stats", mesh_name, routing), TOKENS, routing)
    local = EXPERTS // mesh.shape["expert"]
    seen = []

    def body(*a):
        y, stats = moe_ffn_ep(*a, return_stats=True)
        seen.append(stats)
        return y, stats.expert_counts, stats.pairs_received[None], stats.pairs_dropped[None]

    tokens, devices = P(mesh.axis_names), P(mesh.axis_names)
    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(tokens,) * 3 + (P("expert"),) * 2, out_specs=(tokens, devices, devices, devices)
        )
    )
    _, counts, received, dropped = fn(*args)
    [stats] = seen
    assert isinstance(stats, EPStats)
    assert stats.expert_counts.shape == (local,) and stats.pairs_received.shape == () == stats.pairs_dropped.shape
    assert {stats.expert_counts.dtype, stats.pairs_received.dtype, stats.pairs_dropped.dtype} == {jnp.dtype(jnp.int32)}
    # Counted in numpy: the receiver of the tokens of mesh row r for the experts of shard d is device (r, d).
    ids = np.asarray(args[2])
    rows = mesh.size // mesh.shape["expert"]
    want = np.zeros((rows, EXPERTS), np.int64)
    for row, block in enumerate(ids.reshape(rows, -1)):
        want[row] = np.bincount(block, minlength=EXPERTS)
    want = want.reshape(mesh.size, local)
    np.testing.assert_array_equal(np.asarray(counts).reshape(mesh.size, local), want)
    np.testing.assert_array_equal(np.asarray(received), want.sum(1))
    np.testing.assert_array_equal(np.asarray(dropped), 0)
    if routing == "all_to_one":  # only the last K experts (the last shards) of each row receive anything
        assert np.all(want.reshape(rows, EXPERTS)[:, : EXPERTS - TOP_K] == 0) and want.sum() == TOKENS * TOP_K


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
    """`jax.lax.ragged_all_to_all` built from `all_to_all` (XLA:CPU lacks the op), for the ragged path's logic."""
    ep = jax.lax.axis_size(axis_name)
    rows = jnp.arange(operand.shape[0])
    live = rows[None, :] < send_sizes[:, None]  # [ep, n]
    source = operand.at[input_offsets[:, None] + rows[None, :]].get(mode="fill", fill_value=0)
    blocks = jnp.where(live.reshape(live.shape + (1,) * (operand.ndim - 1)), source, 0)
    received = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    for s in range(ep):
        target = jnp.where(rows < recv_sizes[s], offsets[s] + rows, output.shape[0])
        output = output.at[target].set(received[s], mode="drop")
    return output


def test_ragged_path_lowers_with_the_real_collective(monkeypatch):
    """XLA:CPU cannot compile ragged-all-to-all, but forward and backward must trace and lower."""
    monkeypatch.setattr(transport, "ragged_supported", lambda: True)
    args, dy = make_problem("ragged lower", TOKENS, "uniform")
    fn = functools.partial(value_and_grads, ep_function(make_mesh("data2xep4"), transport="ragged"))
    text = jax.jit(fn).lower(args, dy).as_text()
    assert text.count("ragged_all_to_all") >= 6  # x, ids, weights there; y back; x, weights, y transposed


def test_ragged_probe_runs_outside_the_callers_trace(monkeypatch):
    """The probe compiles and runs its own one-device program even while a shard_map body is traced."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    seen = []

    def body(x):
        seen.append(transport.probe_ragged())
        return x

    jax.jit(jax.shard_map(body, mesh=make_mesh("ep2"), in_specs=P("expert"), out_specs=P("expert")))(jnp.ones(4))
    assert seen == [True]


def test_ragged_probe_on_cpu_and_the_default_transport():
    assert transport.probe_ragged() is False
    assert transport.ragged_supported() is False
    args, dy = make_problem("default transport", TOKENS, "uniform")
    with pytest.raises(ValueError, match="transport='ragged'.*GPU"):
        jax.jit(ep_function(make_mesh("ep2"), transport="ragged"))(*args)
    default = ep_value_and_grads("ep2")(args, dy)  # transport="xla" by default
    for a, b in zip(
        jax.tree.leaves(default), jax.tree.leaves(ep_value_and_grads("ep2", transport="xla")(args, dy)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_matches_reference(ep_value_and_grads("ep2"), args, dy)


def test_implementation_is_passed_through():
    args, dy = make_problem("local reference", TOKENS, "zipf")
    assert_matches_reference(ep_value_and_grads("ep2", implementation="reference"), args, dy)
    with pytest.raises(ValueError, match="implementation must be one of"):
        jax.jit(ep_function(make_mesh("ep2"), implementation="fast"))(*args)


def call_on_ep4(args, **options):
    return jax.jit(ep_function(make_mesh("ep4"), **options))(*args)


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"transport": "nccl"}, ValueError, "transport must be"),
        ({"transport": "auto"}, ValueError, "transport must be"),
        ({"capacity_factor": 0}, ValueError, "capacity_factor must be a finite number > 0"),
        ({"capacity_factor": -1.5}, ValueError, "capacity_factor must be a finite number > 0"),
        ({"capacity_factor": float("nan")}, ValueError, "capacity_factor must be a finite number > 0"),
        ({"capacity_factor": float("inf")}, ValueError, "capacity_factor must be a finite number > 0"),
        ({"capacity_factor": "1.0"}, TypeError, "capacity_factor must be None or a positive number"),
        ({"num_experts": 16.0}, TypeError, "num_experts must be None or an int"),
        ({"num_experts": 18}, ValueError, "num_experts=18 is not divisible by the expert-axis size 4"),
        ({"num_experts": 32}, ValueError, r"leading dimension num_experts / axis size = 32 / 4 = 8, got 4"),
        ({"axis_name": "experts"}, ValueError, "axis_name 'experts' is not bound"),
        ({"axis_name": ("expert",)}, TypeError, "axis_name must be a mesh axis name"),
    ],
)
def test_bad_options(options, error, match):
    args, _ = make_problem("bad", TOKENS, "uniform")
    with pytest.raises(error, match=match):
        call_on_ep4(args, **options)


def test_bad_arrays():
    (x, weights, ids, w_gate_up, w_down), _ = make_problem("bad arrays", TOKENS, "uniform")
    with pytest.raises(ValueError, match="weights must have shape"):
        call_on_ep4((x, weights[:, :2], ids, w_gate_up, w_down))
    with pytest.raises(ValueError, match="w_down must have shape"):
        call_on_ep4((x, weights, ids, w_gate_up, w_down[:, :, :-1]))
    with pytest.raises(ValueError, match="w_gate_up_local must have rank 3"):
        call_on_ep4((x, weights, ids, w_gate_up[0], w_down))
    with pytest.raises(TypeError, match="experts must hold integer"):
        call_on_ep4((x, weights, ids.astype(jnp.float32), w_gate_up, w_down))
    wide_ids, wide_weights = jnp.tile(ids, (1, 5))[:, :17], jnp.tile(weights, (1, 5))[:, :17]
    with pytest.raises(ValueError, match="top_k must be in"):  # K = 17 > E = 16
        call_on_ep4((x, wide_weights, wide_ids, w_gate_up, w_down))


def test_unbound_axis_outside_shard_map():
    args, _ = make_problem("unbound", 8, "uniform")
    with pytest.raises(ValueError, match="axis_name 'expert' is not bound.*shard_map"):
        moe_ffn_ep(*args)


@pytest.mark.parametrize("shards", [2, 4])
def test_under_vmap_over_the_expert_axis(shards):
    """`jax.vmap(axis_name=...)` over shards (how the nvlink transport is emulated on one GPU) gives the
    same result as shard_map over that many devices, forward and gradients."""
    args, dy = make_problem(("vmap", shards), TOKENS, "zipf")
    emulated = jax.vmap(functools.partial(moe_ffn_ep, axis_name="expert", transport="xla"), axis_name="expert")
    y, grads = jitted_value_and_grads(emulated)(tuple(split_shards(a, shards) for a in args), split_shards(dy, shards))
    y_mesh, grads_mesh = ep_value_and_grads(f"ep{shards}", transport="xla")(args, dy)
    for name, got, want in zip(OUTPUT_NAMES, (y, *grads), (y_mesh, *grads_mesh), strict=True):
        np.testing.assert_array_equal(np.asarray(merge_shards(got)), np.asarray(want), err_msg=name)


@pytest.mark.parametrize("routing", ["uniform", "zipf", "empty_experts"])
def test_uncompacted_plan_keeps_each_token_at_its_index(routing):
    """`make_plan(compact=False)`: token t takes slot t at every destination it is sent to, so dispatch_rows gives
    x with the rows of the tokens not sent zeroed, and `sum_blocks` over result blocks that are zero there equals
    `combine_rows` bit for bit (what the nvlink transport's "x as blocks" layout relies on: x itself is every
    destination's block)."""
    from jax_megamoe.parallel.plan import make_plan
    from jax_megamoe.parallel.rows import combine_rows, dispatch_rows, sum_blocks

    ep, tokens = 4, 24
    rng = seeded_rng("uncompacted", routing)
    _, ids = make_routing(rng, tokens, EXPERTS, TOP_K, routing)
    compact = make_plan(jnp.asarray(ids), ep, EXPERTS // ep, tokens * TOP_K, tokens)
    plan = make_plan(jnp.asarray(ids), ep, EXPERTS // ep, tokens * TOP_K, tokens, compact=False)
    sent = np.asarray(compact.slot) >= 0
    index = np.broadcast_to(np.arange(tokens)[:, None], (tokens, ep))
    np.testing.assert_array_equal(plan.slot, np.where(sent, index, -1))
    np.testing.assert_array_equal(plan.token, np.where(sent.T, index.T, tokens))
    np.testing.assert_array_equal(plan.row_counts, compact.row_counts)
    x = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), jnp.bfloat16)
    blocks = dispatch_rows(x, plan.token, plan.slot)
    np.testing.assert_array_equal(blocks, np.where(sent.T[..., None], np.asarray(x)[None], 0))
    results = jnp.asarray(rng.standard_normal((ep, tokens, HIDDEN)) * sent.T[..., None], jnp.bfloat16)
    np.testing.assert_array_equal(sum_blocks(results), combine_rows(results, plan.slot, plan.token))
    with pytest.raises(ValueError, match="uncompacted rows need a slot per token"):
        make_plan(jnp.asarray(ids), ep, EXPERTS // ep, tokens * TOP_K, tokens - 1, compact=False)


# ---------------------------------------------------------------------------------------- the shared checks

pytest_generate_tests = parametrize_cases


class TestXla(TransportBase):
    """The xla transport (all_to_all of padded blocks) on expert axes of 1, 2, 4 and 8 devices and a 2 x 4 mesh."""

    transport = "xla"
    size = Case(16, HIDDEN, INTER, EXPERTS, TOP_K)  # 16 tokens per device
    compared_with_xla = False
    cases = (
        *(EpCase(shards, routing) for shards in (1, 2, 4, 8) for routing in ROUTINGS),
        *(EpCase(4, routing, data=2) for routing in ROUTINGS),
        # Capacities that drop pairs, K > E_local among them (ep8).
        EpCase(4, "zipf", 0.5),
        EpCase(4, "all_to_one", 1.0),
        EpCase(4, "zipf", 0.75, data=2),
        EpCase(8, "uniform", 0.3),
        EpCase(1, "zipf", 0.5),
    )

    def check_program(self, lowered, case):
        text = lowered.as_text()
        assert "ragged_all_to_all" not in text and "jmm_cuda_nvlink" not in text


class TestRagged(TransportBase):
    """The ragged path's logic, its collective built from all_to_all (XLA:CPU lacks ragged-all-to-all)."""

    transport = "ragged"
    size = Case(16, HIDDEN, INTER, EXPERTS, TOP_K)
    cases = (
        EpCase(4, "zipf", 0.5),
        EpCase(4, "zipf", data=2),
        EpCase(8, "all_to_one"),
        EpCase(2, "empty_experts"),
    )

    @pytest.fixture(autouse=True)
    def emulated_collective(self, monkeypatch):
        def named(*args, **kwargs):
            with jax.named_scope("emulated_ragged_all_to_all"):
                return emulated_ragged_all_to_all(*args, **kwargs)

        monkeypatch.setattr(transport, "ragged_supported", lambda: True)
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", named)

    def check_program(self, lowered, case):
        assert "emulated_ragged_all_to_all" in lowered.as_text(debug_info=True)
