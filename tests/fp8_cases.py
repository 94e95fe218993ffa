"""The test base every implementation of the "fp8_blockwise" recipe's kernels subclasses (tests/test_fp8.py: "cpu",
the GEMMs emulated; tests/test_fp8_gpu.py: "cuda"): value and every gradient against the quantisation-exact
reference on fresh random inputs, over the edge cases of the padded row layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from moe_cases import OUTPUT_NAMES, Case, make_problem, rel_error, value_and_grads

import jax_megamoe as jmm

RECIPE = "fp8_blockwise"


def recipe_problem(case: Case, seed="fp8"):
    """bf16 x and dy, float32 master weights (bf16-representable, so the float64 oracles see the same values)."""
    (x, weights, ids, w_gate_up, w_down), dy = make_problem(case, jnp.bfloat16, seed=seed)
    return (x, weights, ids, w_gate_up.astype(jnp.float32), w_down.astype(jnp.float32)), dy


@functools.cache
def recipe_value_and_grads(implementation: str):
    fn = functools.partial(jmm.moe_ffn, implementation=implementation, recipe=RECIPE)
    return jax.jit(functools.partial(value_and_grads, fn))


def recipe_outputs(args, dy, implementation="reference"):
    return tuple(np.asarray(o.astype(jnp.float32)) for o in recipe_value_and_grads(implementation)(tuple(args), dy))


# The kernels' outputs y and the rows of dx are rounded to bf16 before the sum over k (the reference sums in float32):
# about 2**-9 relative. g, d weights and dz follow the reference's float32 math, the weight gradients are written in
# the weights' dtype: float32 summation order only.
TOLERANCE = {"y": 1e-2, "dx": 1e-2, "d_weights": 1e-3, "d_w_gate_up": 1e-3, "d_w_down": 1e-3}


class Fp8KernelsBase:
    """Subclasses set `implementation` and the `cases` they run (small on CPU, where the reference is slow)."""

    implementation: str
    cases: tuple[Case, ...] = (
        Case(64, 256, 128, 8, 2),  # q30-like ratios, one token tile per expert
        Case(300, 256, 128, 4, 2, "zipf"),  # experts past 128 rows: several token tiles, ragged last ones
        Case(96, 136, 72, 8, 2, "empty_experts"),  # H, I not multiples of 128; experts without rows
        Case(64, 128, 128, 4, 1),  # K = 1
        Case(130, 128, 256, 4, 3, "all_to_one"),  # every pair on one expert
        Case(64, 128, 128, 8, 2, "out_of_range"),  # dropped pairs (ids outside [0, E))
    )

    def prepare(self):
        """Runs before each computation (the GPU subclass poisons device memory)."""

    def test_matches_the_reference(self, case_index):
        case = self.cases[case_index]
        args, dy = recipe_problem(case, seed=("fp8 kernels", self.implementation))
        self.prepare()
        got = recipe_outputs(args, dy, self.implementation)
        want = recipe_outputs(args, dy, "reference")
        for name, a, b in zip(OUTPUT_NAMES, got, want, strict=True):
            assert np.all(np.isfinite(a)), (case, name)
            assert rel_error(a, b) < TOLERANCE[name], (case, name, rel_error(a, b))

    def test_outputs_in_x_dtype_and_weight_gradients_in_weights_dtype(self):
        args, dy = recipe_problem(self.cases[0])
        bf16_weights = (*args[:3], args[3].astype(jnp.bfloat16), args[4].astype(jnp.bfloat16))
        for implementation in (self.implementation, "reference"):
            fn = recipe_value_and_grads(implementation)
            out = jax.eval_shape(fn, tuple(args), dy)
            assert [o.dtype for o in out] == [jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32]
            assert [o.dtype for o in jax.eval_shape(fn, bf16_weights, dy)][3:] == [jnp.bfloat16, jnp.bfloat16]

    def test_deterministic(self):
        args, dy = recipe_problem(self.cases[1], seed="fp8 determinism")
        first = recipe_outputs(args, dy, self.implementation)
        self.prepare()
        for a, b in zip(first, recipe_outputs(args, dy, self.implementation), strict=True):
            np.testing.assert_array_equal(a, b)


def parametrize_cases(metafunc):
    """`pytest_generate_tests` of the modules with subclasses: `case_index` over the class's cases."""
    if "case_index" in metafunc.fixturenames:
        cases = metafunc.cls.cases
        metafunc.parametrize("case_index", range(len(cases)), ids=[str(c) for c in cases])
