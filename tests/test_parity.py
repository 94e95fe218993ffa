"""The parity suite: `moe_ffn(..., implementation=...)` against the float32 reference, one test base run for
every implementation ("reference", "cpu", and "cuda" marked `gpu`: `pytest -m gpu` on an H200).

Every check draws a fresh random problem (tests/moe_cases.py), runs the forward and all four gradients in one
jitted call, rejects any non-finite value (how unwritten or poisoned output memory shows) and compares each
output with the float32 reference on the host CPU: normwise relative error <= TOLERANCE[dtype] for the forward
and the gradients (cuda) or twice that for the gradients (reference, cpu: as the CPU suite held them before
the suites were merged). float16 runs on the reference and the CPU kernels; the CUDA kernels refuse it
(tests/test_moe_gpu.py). Also here, per implementation: ids outside [0, E) (int32 and, under x64, int64 past
2**32) are dropped, runs are bitwise deterministic, jit and jax.checkpoint agree with eager calls, backward
passes sharing one forward agree with separate calls, and float64 gradients pass jax.test_util.check_grads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from moe_cases import (
    OUTPUT_NAMES,
    TOLERANCE,
    Case,
    d_weights_scale,
    dropped,
    dropped_token,
    make_problem,
    reference_value_and_grads,
    rel_error,
    value_and_grads,
    without_dropped,
)

import jax_megamoe as jmm
from jax_megamoe import reference

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
IMPLEMENTATIONS = ["reference", "cpu", CUDA]
KERNELS = ["cpu", CUDA]  # the implementations with kernels of their own (aliasing, determinism of the kernels)

# Every implementation: the edge cases.
CASES = [
    Case(16, 24, 12, 8, 2),
    Case(16, 24, 12, 8, 2, "zipf"),
    Case(1, 16, 8, 4, 2),  # T = 1
    Case(12, 16, 8, 6, 1),  # K = 1
    Case(7, 16, 8, 4, 4),  # K = E
    Case(9, 16, 8, 1, 1),  # E = 1
    Case(20, 16, 8, 8, 2, "empty_experts"),
    Case(15, 16, 8, 5, 1, "one_expert"),
    Case(14, 16, 8, 6, 1, "all_to_one"),  # every token on one expert
    Case(11, 13, 7, 5, 3),  # H, I not multiples of 8
    Case(10, 16, 8, 6, 2, "out_of_range"),
]
# The CUDA kernels also: moderate sizes, and their tile, vector-width and edge paths.
CUDA_CASES = [
    Case(256, 128, 64, 16, 4),
    Case(256, 128, 64, 16, 4, "zipf"),
    Case(1, 64, 32, 8, 2),  # T = 1
    Case(64, 64, 32, 8, 1),  # K = 1
    Case(32, 64, 32, 4, 4),  # K = E
    Case(32, 64, 32, 1, 1),  # E = 1
    Case(37, 20, 12, 5, 2),  # H, I not multiples of 8
    Case(19, 33, 7, 3, 3),  # odd everything, K = E
    Case(64, 128, 64, 16, 2, "empty_experts"),
    Case(300, 128, 64, 8, 1, "all_to_one"),  # all tokens on one expert
    Case(48, 64, 32, 8, 3, "out_of_range"),
    # Every path of the SwiGLU backward kernel (one warp per row): I = 13 is the scalar path for both dtypes,
    # I = 24 is 16-byte vectors (3 per bf16 row, 6 per float32 row), I = 2056 has more than 256 vectors per row
    # (several rounds of d_weights' summation threads). 6000 rows exceed the warps resident on an H200 at
    # once, so warps stride over several rows.
    Case(3000, 32, 13, 4, 2),
    Case(3000, 32, 24, 4, 2),
    Case(3000, 32, 2056, 4, 2),
]
# bf16 only on CUDA: several 128 x 256 tensor-core tiles per expert along rows and columns, ragged expert sizes.
CUDA_BF16_CASES = [Case(2048, 512, 384, 32, 4), Case(2048, 512, 384, 32, 4, "zipf")]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _parity_params():
    params = []
    for implementation in IMPLEMENTATIONS:
        name = implementation if isinstance(implementation, str) else implementation.values[0]
        marks = () if isinstance(implementation, str) else implementation.marks
        cases = [(c, d) for c in CASES for d in DTYPES if not (name == "cuda" and d == jnp.float16)]
        if name == "cuda":
            cases += [(c, d) for c in CUDA_CASES for d in (jnp.float32, jnp.bfloat16)]
            cases += [(c, jnp.bfloat16) for c in CUDA_BF16_CASES]
        params += [pytest.param(name, c, d, marks=marks, id=f"{name}-{c}-{jnp.dtype(d).name}") for c, d in cases]
    return params


def implementation_fn(implementation):
    return functools.partial(jmm.moe_ffn, implementation=implementation)


@functools.cache
def jitted_value_and_grads(implementation):
    return jax.jit(functools.partial(value_and_grads, implementation_fn(implementation)))


@functools.lru_cache(maxsize=8)
def problem_and_reference(case, dtype):
    """The check's problem and the float32 reference's outputs: one per (case, dtype), shared by the
    implementations (so a process running several computes the reference once)."""
    args, dy = make_problem(case, dtype, seed="parity")
    return args, dy, reference_value_and_grads(args, dy), d_weights_scale(args, dy)


def assert_close(name, got, want, tol, scale=None):
    """||got - want|| <= tol * ||want||, or tol * ||scale|| where the error's scale is given."""
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert np.all(np.isfinite(got)), f"{name}: non-finite values (unwritten or NaN output)"
    if scale is None:
        err = rel_error(got, want)
    else:
        err = float(np.linalg.norm(got.astype(np.float64) - want) / max(np.linalg.norm(scale), 1e-30))
    assert err <= tol, f"{name}: normwise relative error {err:.3g} > {tol}"


def grad_tolerance(implementation, dtype):
    tol = TOLERANCE[jnp.dtype(dtype).name]
    return tol if implementation == "cuda" else 2 * tol


@pytest.mark.parametrize("implementation, case, dtype", _parity_params())
def test_matches_reference(implementation, case, dtype):
    """Forward and all four gradients against the float32 reference; shapes and dtypes those of the primals;
    under `out_of_range` routing, the token that lost every pair gets zero output and zero dx, and every
    dropped pair a zero weight gradient (exactly). d_weights is judged against the scale of its rounding error
    (tests/moe_cases.py, d_weights_scale), the other outputs against their own norm."""
    args, dy, want, d_weights_scale = problem_and_reference(case, dtype)
    got = jax.block_until_ready(jitted_value_and_grads(implementation)(args, dy))
    tol = TOLERANCE[jnp.dtype(dtype).name]
    primals = (dy, args[0], args[1], args[3], args[4])  # y has dy's shape and dtype (x's)
    for i, (name, g, w, primal) in enumerate(zip(OUTPUT_NAMES, got, want, primals, strict=True)):
        assert g.shape == primal.shape and g.dtype == primal.dtype, (name, g.shape, g.dtype)
        scale = d_weights_scale if name == "d_weights" else None
        assert_close(name, g, w, tol if i == 0 else grad_tolerance(implementation, dtype), scale)
    if case.routing == "out_of_range":
        y, dx, d_weights = (np.asarray(jnp.asarray(a, jnp.float32)) for a in got[:3])
        lost = dropped_token(case.tokens)
        mask = dropped(args[2], case.experts)
        assert mask[lost].all() and mask.any()
        assert np.all(y[lost] == 0) and np.all(dx[lost] == 0)
        assert np.all(d_weights[mask] == 0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_int64_ids_outside_the_range_are_dropped(implementation, dtype):
    """With jax_enable_x64, int64 ids of 2**32 + 1, -2**32 + 1 and E (which an int32 cast would turn into
    expert 1, expert 1 and E) are dropped: the result is bit for bit that of the problem with those pairs
    given id -1, forward and gradients."""
    case = Case(24, 16, 8, 6, 2)
    with jax.enable_x64(True):
        args, dy = make_problem(case, dtype, seed=("int64", implementation))
        ids = np.asarray(args[2]).astype(np.int64)
        ids[0, 0], ids[3, 1], ids[5, :] = 2**32 + 1, -(2**32) + 1, case.experts
        ids[7, 1] = 2**40
        wide = (args[0], args[1], jnp.asarray(ids, jnp.int64), *args[3:])
        assert wide[2].dtype == jnp.int64
        narrow = (args[0], args[1], without_dropped(ids, case.experts), *args[3:])
        fn = jax.jit(functools.partial(value_and_grads, implementation_fn(implementation)))
        got, want = fn(wide, dy), fn(narrow, dy)
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    assert np.all(np.asarray(got[0][5].astype(jnp.float32)) == 0)  # the token whose ids were all E


# Per implementation, the sizes the suites held each at before they were merged.
SMALL = Case(32, 24, 12, 8, 4, "zipf")
DETERMINISM_CASES = {"reference": SMALL, "cpu": SMALL, "cuda": Case(1024, 256, 128, 16, 4, "zipf")}
CHECKPOINT_CASES = {"reference": Case(16, 16, 8, 4, 2), "cpu": Case(16, 16, 8, 4, 2), "cuda": Case(256, 128, 64, 8, 2)}
SHARED_FORWARD_CASES = {"cpu": Case(64, 32, 16, 8, 2, "zipf"), "cuda": Case(512, 128, 64, 8, 2, "zipf")}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bitwise_deterministic(implementation, dtype):
    args, dy = make_problem(DETERMINISM_CASES[implementation], dtype, seed="determinism")
    fn = jitted_value_and_grads(implementation)
    first, second = fn(args, dy), fn(args, dy)
    for name, a, b in zip(OUTPUT_NAMES, first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=name)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_jit_and_checkpoint_match_eager(implementation):
    """Eager, jitted and jitted-under-jax.checkpoint gradients agree (to 1e-6); the kernels' recomputation
    under jax.checkpoint gives the plain call's gradients bit for bit (the same kernels on the same rows)."""
    args, dy = make_problem(CHECKPOINT_CASES[implementation], jnp.float32, seed="checkpoint")
    fn = implementation_fn(implementation)
    eager = value_and_grads(fn, args, dy)
    jitted = jax.jit(functools.partial(value_and_grads, fn))(args, dy)
    remat = jax.jit(functools.partial(value_and_grads, jax.checkpoint(fn)))(args, dy)
    for name, e, j, r in zip(OUTPUT_NAMES, eager, jitted, remat, strict=True):
        np.testing.assert_allclose(j, e, rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(r, e, rtol=1e-6, atol=1e-6, err_msg=name)
        if implementation != "reference":
            np.testing.assert_array_equal(np.asarray(r), np.asarray(j), err_msg=name)


@pytest.mark.parametrize("implementation", KERNELS)
def test_bf16_checkpoint_is_bitwise_the_plain_gradient(implementation):
    args, dy = make_problem(CHECKPOINT_CASES[implementation], jnp.bfloat16, seed="bf16 checkpoint")
    fn = implementation_fn(implementation)
    plain = jax.jit(functools.partial(value_and_grads, fn))(args, dy)
    remat = jax.jit(functools.partial(value_and_grads, jax.checkpoint(fn)))(args, dy)
    for name, a, b in zip(OUTPUT_NAMES, plain, remat, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


@pytest.mark.parametrize("implementation", KERNELS)
def test_backward_passes_sharing_one_forward(implementation):
    """The CUDA backward writes dz over its gate_up operand (an aliased result, jax_megamoe/_targets.py):
    backward passes that share one forward must each still read the forward's gate_up (XLA copies it for all
    but the last), in one jit and eagerly, and give the gradients of separate forward+backward calls bit for
    bit. The same holds of the CPU kernels, which alias nothing."""
    args, dy = make_problem(SHARED_FORWARD_CASES[implementation], jnp.bfloat16, seed="shared")
    x, weights, experts, w_gate_up, w_down = args
    fn = implementation_fn(implementation)
    cotangents = (dy, (-2 * dy.astype(jnp.float32)).astype(dy.dtype))

    def shared(*primals):
        _, vjp = jax.vjp(lambda a, w, g, d: fn(a, w, experts, g, d), *primals)
        return [vjp(ct) for ct in cotangents]

    primals = (x, weights, w_gate_up, w_down)
    one_pass = jax.jit(functools.partial(value_and_grads, fn))
    separate = [one_pass(args, ct)[1:] for ct in cotangents]
    for got in (jax.jit(shared)(*primals), shared(*primals)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(separate), strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("implementation", ["reference", "cpu"])
@pytest.mark.parametrize("case", [Case(5, 6, 3, 3, 2), Case(4, 5, 4, 2, 1, "out_of_range")], ids=str)
def test_check_grads_float64(implementation, case):
    with jax.enable_x64(True):
        (x, weights, experts, w_gate_up, w_down), _ = make_problem(case, jnp.float64, seed="float64")
        weights = weights.astype(jnp.float64)

        def fn(x, weights, w_gate_up, w_down):
            return jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, implementation=implementation)

        jax.test_util.check_grads(fn, (x, weights, w_gate_up, w_down), order=1, modes=("rev",), atol=1e-7, rtol=1e-7)
        y = fn(x, weights, w_gate_up, w_down)
        assert rel_error(y, reference.moe_ffn(x, weights, experts, w_gate_up, w_down)) <= TOLERANCE["float64"]
