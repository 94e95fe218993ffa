"""Clear errors for every misuse of issue 23 item 5 (CPU): non-array arguments name the argument; an
implementation that cannot run where it is traced or lowered says so in jax_megamoe's words (not XLA's "No FFI
handler registered"); a transport that cannot run on the mesh says so. (Out-of-range ids of any integer dtype:
tests/test_parity.py for moe_ffn, tests/test_ep.py for moe_ffn_ep.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from moe_cases import Case, make_problem, value_and_grads

import jax_megamoe as jmm

CASE = Case(6, 8, 4, 4, 2)
ARG_NAMES = ("x", "weights", "experts", "w_gate_up", "w_down")
NOT_ARRAYS = {
    "list": lambda a: np.asarray(a).tolist(),
    "None": lambda a: None,
    "float": lambda a: 1.5,
    "int": lambda a: 3,
}


def problem():
    args, _ = make_problem(CASE, jnp.float32, seed="errors")
    return args


@pytest.mark.parametrize("kind", NOT_ARRAYS)
@pytest.mark.parametrize("position", range(5), ids=lambda i: ARG_NAMES[i])
@pytest.mark.parametrize("implementation", ["auto", "reference", "cpu"])
def test_non_array_argument_is_a_type_error_naming_it(implementation, position, kind):
    args = list(problem())
    args[position] = NOT_ARRAYS[kind](args[position])
    name = ARG_NAMES[position]
    with pytest.raises(TypeError, match=rf"^{name} must be an array \(jax\.Array or numpy\.ndarray\)") as err:
        jmm.moe_ffn(*args, implementation=implementation)
    if kind == "list":
        assert "got list" in str(err.value)


@pytest.mark.parametrize("kind", NOT_ARRAYS)
def test_route_needs_an_array_of_logits(kind):
    logits = make_problem(Case(6, 8, 4, 4, 2), jnp.float32, seed="route")[0][0][:, :4]
    with pytest.raises(TypeError, match=r"^router_logits must be an array \(jax\.Array or numpy\.ndarray\)"):
        jmm.route(NOT_ARRAYS[kind](logits), 2)


@pytest.mark.parametrize("implementation", ["reference", "cpu"])
def test_numpy_arrays_are_arrays(implementation):
    args = problem()
    got = jmm.moe_ffn(*(np.asarray(a) for a in args), implementation=implementation)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jmm.moe_ffn(*args, implementation=implementation)))
    weights, experts = jmm.route(np.asarray(args[0][:, :4]), 2)
    want = jmm.route(args[0][:, :4], 2)
    np.testing.assert_array_equal(weights, want[0])
    np.testing.assert_array_equal(experts, want[1])


def lower_for_cuda(fn, args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("gradients", [False, True], ids=["forward", "forward_backward"])
def test_cpu_kernels_lowered_for_cuda_fail_with_our_message(gradients):
    """`implementation="cpu"` traced here (a CPU machine: allowed) and lowered for CUDA: every jmm_cpu_* call
    refuses the platform with jax_megamoe's message before XLA could say "No FFI handler registered"."""
    args, dy = make_problem(CASE, jnp.float32, seed="errors")
    fn = functools.partial(jmm.moe_ffn, implementation="cpu")
    if gradients:
        fn = functools.partial(lambda f, *a: value_and_grads(f, a, dy), fn)
    with pytest.raises(ValueError, match="implementation='cpu'") as err:
        lower_for_cuda(fn, args)
    message = str(err.value)
    assert "No FFI handler" not in message and "cuda" in message.lower()


def test_reference_lowers_for_cuda():
    """The pure-JAX reference runs anywhere: lowering it for CUDA on a CPU machine works."""
    text = lower_for_cuda(functools.partial(jmm.moe_ffn, implementation="reference"), problem()).as_text()
    assert "jmm_" not in text


@pytest.mark.parametrize("jit", [False, True])
def test_cuda_on_a_cpu_machine_fails_at_trace_time(jit):
    args = problem()
    fn = functools.partial(jmm.moe_ffn, implementation="cuda")
    with pytest.raises(ValueError, match="implementation='cuda'") as err:
        if jit:
            jax.jit(fn).trace(*args)  # tracing alone: before any lowering
        else:
            fn(*args)
    assert "No FFI handler" not in str(err.value)


@pytest.mark.parametrize(
    "implementation, error, match",
    [
        ("tpu", ValueError, r"implementation must be one of \('auto', 'cpu', 'cuda', 'reference'\), got 'tpu'"),
        ("CPU", ValueError, "implementation must be one of"),
        (None, (TypeError, ValueError), "implementation"),
    ],
)
def test_unknown_implementation(implementation, error, match):
    with pytest.raises(error, match=match):
        jmm.moe_ffn(*problem(), implementation=implementation)


def test_old_keywords_are_gone():
    with pytest.raises(TypeError, match="backend"):
        jmm.moe_ffn(*problem(), backend="cpu")


def ep_call(args, **options):
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    spec = P("expert")
    fn = jax.shard_map(functools.partial(jmm.moe_ffn_ep, **options), mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    return jax.jit(fn)(*args)


def ep_problem():
    args, _ = make_problem(Case(8, 16, 8, 4, 2), jnp.float32, seed="ep errors")
    return args


def test_ragged_transport_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"transport='ragged'.*GPU") as err:
        ep_call(ep_problem(), transport="ragged")
    assert "No FFI handler" not in str(err.value)


@pytest.mark.parametrize(
    "transport, error, match",
    [
        ("nccl", ValueError, r"transport must be"),
        ("auto", ValueError, r"transport must be"),
        ("nvlink", (TypeError, ValueError), r"NvlinkTransport"),  # the nvlink transport is an object, not a name
        (object(), (TypeError, ValueError), r"transport must be"),
    ],
)
def test_unknown_transport(transport, error, match):
    with pytest.raises(error, match=match):
        ep_call(ep_problem(), transport=transport)


@pytest.mark.parametrize("old", [{"backend": "xla"}, {"local_backend": "cpu"}, {"workspace": None}])
def test_old_ep_keywords_are_gone(old):
    with pytest.raises(TypeError):
        ep_call(ep_problem(), **old)


def test_cuda_implementation_under_moe_ffn_ep_on_cpu_fails_at_trace_time():
    with pytest.raises(ValueError, match="implementation='cuda'"):
        ep_call(ep_problem(), implementation="cuda")
