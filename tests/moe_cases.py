"""Problem generators and error measures shared by the MoE tests (CPU and GPU)."""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import reference


@dataclasses.dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    routing: str = "uniform"  # uniform | zipf | one_expert | empty_experts | out_of_range

    def __str__(self):
        return f"T{self.tokens}-H{self.hidden}-I{self.inter}-E{self.experts}-K{self.top_k}-{self.routing}"


def seeded_rng(*parts) -> np.random.Generator:
    """A generator seeded from the test's parameters: fresh inputs per check, reproducible failures."""
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def make_routing(rng: np.random.Generator, case: Case) -> tuple[np.ndarray, np.ndarray]:
    """Returns `(weights [T,K] float32, experts [T,K] int32)` with distinct experts per token."""
    t, e, k = case.tokens, case.experts, case.top_k
    if case.routing == "zipf":
        probs = 1.0 / np.arange(1, e + 1) ** 1.2
    elif case.routing == "empty_experts":
        probs = np.zeros(e)
        probs[: max(k, e // 2)] = 1.0  # the upper half of the experts gets no token
    else:
        probs = np.ones(e)
    probs = probs / probs.sum()
    experts = np.stack([rng.choice(e, size=k, replace=False, p=probs) for _ in range(t)]).astype(np.int32)
    if case.routing == "one_expert":
        experts[:, 0] = 0
        experts[:, 1:] = (experts[:, 1:] % (e - 1)) + 1 if e > 1 else 0
    if case.routing == "out_of_range":
        experts[rng.random((t, k)) < 0.3] = e + 3
        experts[0, 0] = -1
    weights = rng.random((t, k)).astype(np.float32) + 0.1
    return weights / weights.sum(axis=1, keepdims=True), experts


def make_problem(rng: np.random.Generator, case: Case, dtype) -> tuple:
    """Fresh random `(x, weights, experts, w_gate_up, w_down)` in `dtype` (weights stay float32)."""
    h, i, e = case.hidden, case.inter, case.experts
    x = rng.standard_normal((case.tokens, h))
    w_gate_up = rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)
    w_down = rng.standard_normal((e, i, h)) / np.sqrt(i)
    weights, experts = make_routing(rng, case)
    return (jnp.asarray(x, dtype), jnp.asarray(weights), jnp.asarray(experts),
            jnp.asarray(w_gate_up, dtype), jnp.asarray(w_down, dtype))


def random_problem(seed: int, tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype,
                   log_p: jax.Array) -> tuple:
    """Fresh `(x, weights, experts, w_gate_up, w_down), dy` drawn on the device from `PRNGKey(seed)`:
    distinct experts per token with log-popularity `log_p [E]` (-inf: never chosen), softmax weights."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    ids = jax.lax.top_k(log_p + jax.random.gumbel(keys[0], (tokens, experts)), top_k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[1], (tokens, top_k)), axis=-1)
    x = jax.random.normal(keys[2], (tokens, hidden)).astype(dtype)
    w_gate_up = (jax.random.normal(keys[3], (experts, hidden, 2 * inter)) / np.sqrt(hidden)).astype(dtype)
    w_down = (jax.random.normal(keys[4], (experts, inter, hidden)) / np.sqrt(inter)).astype(dtype)
    dy = jax.random.normal(keys[5], (tokens, hidden)).astype(dtype)
    return (x, weights, ids, w_gate_up, w_down), dy


def value_and_grads(fn, args, dy) -> tuple:
    """`(y, dx, d_weights, d_w_gate_up, d_w_down)` of `fn(x, weights, experts, w_gate_up, w_down)` for the
    cotangent `dy` (cast to y's dtype)."""
    x, weights, ids, w_gate_up, w_down = args
    y, vjp = jax.vjp(lambda a, w, g, d: fn(a, w, ids, g, d), x, weights, w_gate_up, w_down)
    return (y, *vjp(dy.astype(y.dtype)))


def reference_value_and_grads(args, dy) -> tuple:
    """The float32 reference's `(y, dx, d_weights, d_w_gate_up, d_w_down)` for `(x, weights, experts,
    w_gate_up, w_down)` and cotangent `dy`, as numpy arrays; bf16 inputs are promoted to float32.

    Computed by one jit on the host CPU, wherever the inputs live: there the reference is exact float32 and
    compiles in seconds. Jitted on a GPU, XLA autotunes each of its unrolled per-expert matmuls, which took
    minutes per problem and stalled parallel GPU test workers (2026-11-30 H200 runs)."""
    widen = lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
    args, dy = jax.device_put((tuple(args), dy), jax.devices("cpu")[0])
    out = jax.jit(functools.partial(value_and_grads, reference.moe_ffn))(tuple(map(widen, args)), widen(dy))
    return tuple(np.asarray(o) for o in out)


def rel_error(actual, expected) -> float:
    """Normwise relative error ||a - b|| / ||b|| in float64; NaN anywhere gives inf."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# normwise tolerance per dtype against a float32/float64 reference (DESIGN §6)
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 1e-2, "float16": 3e-3}
