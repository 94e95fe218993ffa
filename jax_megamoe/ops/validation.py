"""Argument checks that run at trace time, before any kernel: clear errors naming the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def check_array(name: str, value, layout: str) -> None:
    """Arrays only: a list, None or a Python scalar gets a TypeError naming the argument, not a failure deeper."""
    if not isinstance(value, (jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            f"{name} must be an array (jax.Array or numpy.ndarray) of shape {layout}, got "
            f"{type(value).__name__}; convert it with jnp.asarray"
        )


def check_rank(name: str, value, rank: int, layout: str) -> None:
    check_array(name, value, layout)
    if np.ndim(value) != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {tuple(np.shape(value))}")


def check_float(name: str, value) -> None:
    if jnp.dtype(value.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{name} must be a floating dtype (float16, bfloat16, float32, float64), got {value.dtype}")


def check_integer(name: str, value) -> None:
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer expert ids, got dtype {value.dtype}")


def check_shape(name: str, value, expected: tuple, layout: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, got {tuple(value.shape)}")


def check_top_k(top_k, num_experts: int) -> None:
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool):
        raise TypeError(f"top_k must be a Python int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")


def check_route_args(router_logits, top_k) -> None:
    check_rank("router_logits", router_logits, 2, "[T, E]")
    check_float("router_logits", router_logits)
    check_top_k(top_k, router_logits.shape[1])


def check_recorded_routing(recorded, tokens: int, top_k: int) -> None:
    """A routing record for `tokens` tokens of `top_k` experts each: integer `[T, K]`."""
    check_array("recorded routing", recorded, "[T, K]")
    if not jnp.issubdtype(recorded.dtype, jnp.integer):
        raise TypeError(f"recorded routing must hold integer expert ids (-1: no record), got dtype {recorded.dtype}")
    check_shape("recorded routing", recorded, (tokens, top_k), "[T, K]")


def check_moe_args(
    x, weights, experts, w_gate_up, w_down, num_experts: int | None = None
) -> tuple[int, int, int, int, int]:
    """Checks `moe_ffn`'s arguments; returns `(T, H, I, E_local, K)`.

    `num_experts` is the global expert count where it differs from the local weights' (expert parallelism).
    """
    check_rank("x", x, 2, "[T, H]")
    check_rank("weights", weights, 2, "[T, K]")
    check_rank("experts", experts, 2, "[T, K]")
    check_rank("w_gate_up", w_gate_up, 3, "[E, H, 2I]")
    check_rank("w_down", w_down, 3, "[E, I, H]")
    for name, value in (("x", x), ("weights", weights), ("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_float(name, value)
    check_integer("experts", experts)
    tokens, hidden = x.shape
    local_experts, _, two_inter = w_gate_up.shape
    if two_inter % 2:
        raise ValueError(f"w_gate_up's last dimension holds [gate, up] and must be even (2I), got {two_inter}")
    inter = two_inter // 2
    top_k = experts.shape[1]
    check_shape("w_gate_up", w_gate_up, (local_experts, hidden, two_inter), "[E, H, 2I]")
    check_shape("w_down", w_down, (local_experts, inter, hidden), "[E, I, H]")
    check_shape("weights", weights, (tokens, top_k), "[T, K]")
    check_shape("experts", experts, (tokens, top_k), "[T, K]")
    check_top_k(top_k, num_experts if num_experts is not None else local_experts)
    if not (x.dtype == w_gate_up.dtype == w_down.dtype):
        raise TypeError(
            f"x, w_gate_up and w_down must share one dtype (cast the weights to the compute dtype), "
            f"got x {x.dtype}, w_gate_up {w_gate_up.dtype}, w_down {w_down.dtype}"
        )
    return tokens, hidden, inter, local_experts, top_k
