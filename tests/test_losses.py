"""`jax_megamoe.losses.linear_cross_entropy` on CPU: the shared checks (tests/loss_cases.py) for the reference and
the CPU kernel, and the argument checks."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from loss_cases import LinearCrossEntropyBase, optax_loss, problem, rel

from jax_megamoe import _ffi, losses


class TestReference(LinearCrossEntropyBase):
    IMPLEMENTATION = "reference"


@pytest.mark.skipif(not _ffi.has_cpu_kernels(), reason="the compiled extension is not built")
class TestCpuKernel(LinearCrossEntropyBase):
    IMPLEMENTATION = "cpu"


def test_auto_takes_the_reference_for_other_dtypes():
    h, kernel, labels, where = problem(5, 10, 8, 19, jnp.float16)
    value = losses.linear_cross_entropy(h, kernel, labels, where=where)
    ref = optax_loss(h, kernel, labels, where, "mean")
    assert abs(float(value - ref)) <= 1e-2 * abs(float(ref))
    assert rel(value, ref) <= 1e-2


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(labels=[1, 2]), TypeError),
        (dict(labels=jnp.array([0, 10, 1])), ValueError),  # a concrete label >= V
        (dict(reduction="max"), ValueError),
        (dict(where=jnp.ones(3, jnp.int32)), ValueError),
        (dict(kernel=jnp.ones((5, 10))), ValueError),
        (dict(implementation="triton"), ValueError),
        (dict(implementation="cuda"), ValueError),  # no GPU here, or no CUDA kernels
        (
            dict(implementation="cpu", hidden=jnp.ones((3, 4), jnp.float16), kernel=jnp.ones((4, 10), jnp.float16)),
            ValueError,
        ),
    ],
)
def test_bad_arguments(bad, error):
    args = dict(hidden=jnp.ones((3, 4)), kernel=jnp.ones((4, 10)), labels=jnp.array([0, 1, 2]))
    args.update(bad)
    kwargs = {k: args.pop(k) for k in ("where", "reduction", "implementation") if k in args}
    with pytest.raises(error):
        losses.linear_cross_entropy(args["hidden"], args["kernel"], args["labels"], **kwargs)
