"""moe_ffn rejects bad inputs before any kernel runs, naming the argument and expected vs got."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import normal

import jax_megamoe as jmm

T, H, I, E, K = 6, 8, 4, 4, 2


def _args(**overrides):
    args = dict(
        x=jnp.ones((T, H), jnp.float32),
        weights=jnp.ones((T, K), jnp.float32),
        experts=jnp.zeros((T, K), jnp.int32),
        w_gate_up=jnp.ones((E, H, 2 * I), jnp.float32),
        w_down=jnp.ones((E, I, H), jnp.float32),
    )
    args.update(overrides)
    return args


BAD_INPUTS = [
    (dict(x=jnp.ones((T, H, 1))), ValueError, r"x must have rank 2 \(\[T, H\]\), got shape \(6, 8, 1\)"),
    (dict(weights=jnp.ones((T,))), ValueError, "weights must have rank 2"),
    (dict(experts=jnp.zeros((T, K, 1), jnp.int32)), ValueError, "experts must have rank 2"),
    (dict(w_gate_up=jnp.ones((H, 2 * I))), ValueError, r"w_gate_up must have rank 3 \(\[E, H, 2I\]\)"),
    (dict(w_down=jnp.ones((I, H))), ValueError, r"w_down must have rank 3 \(\[E, I, H\]\)"),
    (dict(w_gate_up=jnp.ones((E, H, 2 * I + 1))), ValueError, "must be even"),
    (
        dict(w_gate_up=jnp.ones((E, H + 1, 2 * I))),
        ValueError,
        r"w_gate_up must have shape \[E, H, 2I\] = \(4, 8, 8\), got \(4, 9, 8\)",
    ),
    (
        dict(w_down=jnp.ones((E + 1, I, H))),
        ValueError,
        r"w_down must have shape \[E, I, H\] = \(4, 4, 8\), got \(5, 4, 8\)",
    ),
    (dict(w_down=jnp.ones((E, I + 1, H))), ValueError, "w_down must have shape"),
    (dict(weights=jnp.ones((T, K + 1))), ValueError, r"weights must have shape \[T, K\] = \(6, 2\), got \(6, 3\)"),
    (dict(experts=jnp.zeros((T + 1, K), jnp.int32)), ValueError, r"experts must have shape \[T, K\]"),
    (
        dict(experts=jnp.zeros((T, K), jnp.float32)),
        TypeError,
        "experts must hold integer expert ids, got dtype float32",
    ),
    (dict(x=jnp.ones((T, H), jnp.int32)), TypeError, "x must be a floating dtype"),
    (dict(weights=jnp.ones((T, K), jnp.int32)), TypeError, "weights must be a floating dtype"),
    (dict(x=jnp.ones((T, H), jnp.bfloat16)), TypeError, "x, w_gate_up and w_down must share one dtype"),
    (
        dict(weights=jnp.ones((T, E + 1)), experts=jnp.zeros((T, E + 1), jnp.int32)),
        ValueError,
        r"top_k must be in \[1, E=4\], got 5",
    ),
]


@pytest.mark.parametrize("overrides, error, match", BAD_INPUTS)
@pytest.mark.parametrize("implementation", ["cpu", "reference"])
def test_bad_inputs_raise_before_any_kernel(overrides, error, match, implementation):
    with pytest.raises(error, match=match):
        jmm.moe_ffn(**_args(**overrides), implementation=implementation)


def test_out_of_range_ids_are_dropped_not_read():
    """Ids far outside [0, E) must not crash or read out of bounds: those pairs contribute zero."""
    experts = np.array([[0, 2**30], [-(2**30), 1], [3, 4], [5, -1], [1, 2], [0, 3]], np.int32)
    args = _args(experts=jnp.asarray(experts), x=normal("out of range", (T, H)))
    y_cpu = jmm.moe_ffn(**args, implementation="cpu")
    y_ref = jmm.moe_ffn(**args, implementation="reference")
    np.testing.assert_allclose(y_cpu, y_ref, rtol=1e-5)
