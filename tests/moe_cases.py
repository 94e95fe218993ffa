"""The one problem generator of the MoE tests (CPU and GPU, single device and expert-parallel), and the
error measures they share.

Every random input of the suite comes from here: `make_problem` draws a whole MoE problem
`(x, weights, experts, w_gate_up, w_down), dy` for a `Case` (sizes and a routing pattern), `normal` any other
random array (a layer's input, a router's weights). Draws are numpy's, seeded from the caller's `seed` and the
case, so each check has fresh inputs and a failure reproduces from its parameters alone.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import reference

# Routing patterns (distinct experts per token unless said otherwise):
#   uniform        every expert equally likely
#   zipf           expert e's popularity ~ 1 / (e + 1)^1.2 (expert 0 the hottest, as the benchmarks route)
#   one_expert     every token's first pick is expert 0, its others are drawn from the rest
#   all_to_one     every token picks experts E-1, E-2, ..., E-K (all on the last expert shard when K <= E_local)
#   empty_experts  no token picks an expert of the upper half, nor one with e % 4 == 3 (empty experts between
#                  used ones, and whole empty expert shards), as long as K experts remain
#   out_of_range   uniform, then about 30% of the pairs get ids outside [0, E) (-1, E, E + 3, 2**30, -2**30), the
#                  middle token all of its pairs, and pair (0, 0) the id -1
ROUTINGS = ("uniform", "zipf", "one_expert", "all_to_one", "empty_experts", "out_of_range")


@dataclasses.dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    routing: str = "uniform"

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")

    def __str__(self):
        return f"T{self.tokens}-H{self.hidden}-I{self.inter}-E{self.experts}-K{self.top_k}-{self.routing}"


def seeded_rng(*parts) -> np.random.Generator:
    """A generator seeded from the test's parameters: fresh inputs per check, reproducible failures."""
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def _top_k_distinct(rng: np.random.Generator, log_p: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """[tokens, top_k] distinct ids, each token's drawn without replacement with probabilities ~ exp(log_p)
    (Gumbel top-k); ids with log_p = -inf are never drawn."""
    assert np.sum(np.isfinite(log_p)) >= top_k, "fewer allowed experts than top_k"
    scores = log_p[None, :] + rng.gumbel(size=(tokens, log_p.size))
    return np.argsort(-scores, axis=1, kind="stable")[:, :top_k]


def dropped_token(tokens: int) -> int:
    """The token that loses every pair under `out_of_range` routing."""
    return tokens // 2


def make_routing(rng: np.random.Generator, tokens: int, experts: int, top_k: int, routing: str = "uniform"):
    """`(weights [T, K] float32, ids [T, K] int32)` for one routing pattern (see ROUTINGS); weights are
    positive and sum to 1 per token."""
    e, k = experts, top_k
    if not 1 <= k <= e:
        raise ValueError(f"top_k must be in [1, E={e}], got {k}")
    log_p = np.zeros(e)
    if routing == "zipf":
        log_p = -1.2 * np.log1p(np.arange(e))
    elif routing == "empty_experts":
        allowed = (np.arange(e) < e // 2) & (np.arange(e) % 4 != 3)
        if allowed.sum() < k:
            allowed = np.arange(e) < max(k, e // 2)
        log_p = np.where(allowed, 0.0, -np.inf)
    if routing == "one_expert":
        others = (
            _top_k_distinct(rng, np.where(np.arange(e) == 0, -np.inf, 0.0), tokens, k - 1)
            if k > 1
            else np.zeros((tokens, 0), np.int64)
        )
        ids = np.concatenate([np.zeros((tokens, 1), np.int64), others], axis=1)
    elif routing == "all_to_one":
        ids = np.tile(e - 1 - np.arange(k), (tokens, 1))
    else:
        ids = _top_k_distinct(rng, log_p, tokens, k)
    ids = ids.astype(np.int64)
    if routing == "out_of_range":
        bad = rng.random((tokens, k)) < 0.3
        bad[dropped_token(tokens)] = True
        ids = np.where(bad, rng.choice(np.asarray([-1, e, e + 3, 2**30, -(2**30)]), size=(tokens, k)), ids)
        ids[0, 0] = -1
    weights = rng.random((tokens, k)) + 0.1
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32), ids.astype(np.int32)


def make_problem(case: Case, dtype, *, seed, experts=None):
    """Fresh random `(x, weights, experts, w_gate_up, w_down), dy` for `case` in `dtype`, as jax arrays on the
    default device: x, the expert weights and the cotangent dy in `dtype`, the routing weights float32, the
    ids int32. `seed`: anything with a stable repr (the test's parameters); `experts`: ids to use instead of
    the case's routing (the routing weights are still drawn)."""
    rng = seeded_rng(seed, str(case), _dtype_name(dtype))
    t, h, i, e, k = case.tokens, case.hidden, case.inter, case.experts, case.top_k
    weights, ids = make_routing(rng, t, e, k, case.routing)
    if experts is not None:
        ids = np.asarray(experts)
        assert ids.shape == (t, k), (ids.shape, (t, k))
    x = rng.standard_normal((t, h))
    w_gate_up = rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)
    w_down = rng.standard_normal((e, i, h)) / np.sqrt(i)
    dy = rng.standard_normal((t, h))
    args = (
        jnp.asarray(x, dtype),
        jnp.asarray(weights),
        jnp.asarray(ids, np.int32 if experts is None else ids.dtype),
        jnp.asarray(w_gate_up, dtype),
        jnp.asarray(w_down, dtype),
    )
    return args, jnp.asarray(dy, dtype)


def normal(seed, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    """A standard-normal array (times `scale`) for inputs that are not a whole MoE problem."""
    return jnp.asarray(seeded_rng("normal", seed, tuple(shape)).standard_normal(shape) * scale, dtype)


def dropped(experts, num_experts: int) -> np.ndarray:
    """Which pairs an implementation must drop: ids outside [0, E)."""
    ids = np.asarray(experts)
    return (ids < 0) | (ids >= num_experts)


def without_dropped(experts, num_experts: int) -> jax.Array:
    """The ids with every out-of-range pair as -1, int32: the problem an implementation must solve."""
    return jnp.asarray(np.where(dropped(experts, num_experts), -1, np.asarray(experts)).astype(np.int32))


def split_shards(a, ranks: int):
    """[R·n, ...] -> [R, n, ...]: shard r holds rows (tokens or experts) r·n .. r·n + n - 1."""
    return a.reshape((ranks, a.shape[0] // ranks) + a.shape[1:])


def merge_shards(a):
    """[R, n, ...] -> [R·n, ...]."""
    return jnp.asarray(a).reshape((-1,) + a.shape[2:])


def value_and_grads(fn, args, dy) -> tuple:
    """`(y, dx, d_weights, d_w_gate_up, d_w_down)` of `fn(x, weights, experts, w_gate_up, w_down)` for the
    cotangent `dy` (cast to y's dtype)."""
    x, weights, ids, w_gate_up, w_down = args
    y, vjp = jax.vjp(lambda a, w, g, d: fn(a, w, ids, g, d), x, weights, w_gate_up, w_down)
    return (y, *vjp(dy.astype(y.dtype)))


OUTPUT_NAMES = ("y", "dx", "d_weights", "d_w_gate_up", "d_w_down")


def widen(a):
    """bf16 and float16 arrays as float32; anything else unchanged."""
    return a.astype(jnp.float32) if a.dtype in (jnp.bfloat16, jnp.float16) else a


@functools.cache
def _jitted_reference():
    return jax.jit(functools.partial(value_and_grads, reference.moe_ffn))


def reference_value_and_grads(args, dy) -> tuple:
    """The float32 reference's `(y, dx, d_weights, d_w_gate_up, d_w_down)` for `(x, weights, experts,
    w_gate_up, w_down)` and cotangent `dy`, as numpy arrays; bf16 and float16 inputs are promoted to float32.

    Computed by one jit on the host CPU, wherever the inputs live: there the reference is exact float32 and
    compiles in seconds. Jitted on a GPU, XLA autotunes each of its unrolled per-expert matmuls, which takes
    minutes per problem and stalls parallel GPU test workers. One jitted function for every call, so
    problems of one shape (in any of the promoted dtypes) compile it once."""
    args, dy = jax.device_put((tuple(args), dy), jax.devices("cpu")[0])
    out = _jitted_reference()(tuple(map(widen, args)), widen(dy))
    return tuple(np.asarray(o) for o in out)


@jax.jit
def _d_weights_scale(x, experts, w_gate_up, w_down, dy):
    per_expert = jnp.stack(
        [
            jnp.sum(jnp.abs(dy) * jnp.abs(reference.expert_mlp(x, w_gate_up[e], w_down[e])), axis=-1)
            for e in range(w_gate_up.shape[0])
        ]
    )  # [E, T]
    valid = (experts >= 0) & (experts < w_gate_up.shape[0])
    ids = jnp.where(valid, experts, 0)
    return jnp.where(valid, jnp.take_along_axis(per_expert.T, ids, axis=1), 0)


def d_weights_scale(args, dy) -> np.ndarray:
    """`sum_h |dy[t, h]| * |f_e(x[t])[h]|` per pair (t, k) with e = experts[t, k] (0 for dropped pairs): the
    scale of d_weights' rounding error. d_weights[t, k] is a dot product over H, whose error is bounded by
    eps times this sum whatever the cancellation, so tiny problems (T = 1: two entries) are judged against it
    rather than against |d_weights| itself. float32 on the host CPU, like the reference."""
    x, _, experts, w_gate_up, w_down = jax.device_put(tuple(args), jax.devices("cpu")[0])
    dy = jax.device_put(dy, jax.devices("cpu")[0])
    return np.asarray(_d_weights_scale(widen(x), experts, widen(w_gate_up), widen(w_down), widen(dy)))


def rel_error(actual, expected) -> float:
    """Normwise relative error ||a - b|| / ||b|| in float64; NaN anywhere gives inf."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# normwise tolerance per dtype against a float32/float64 reference
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 1e-2, "float16": 3e-3}
