"""The JAX implementations (ours, its tiles, graphs and FP8 variants, and the pure-JAX peers: ragged_dot, tokamax,
gshard), their variants and routing, and one JAX row: inputs drawn, peak memory of one forward+backward, times."""

from __future__ import annotations

import math
import os
import sys

import benchmarks

from .impls import FP8_IMPL, GRAPHS_IMPL, gemm_config, is_tiles_impl
from .shapes import CONFIGS, VARIANTS, log_prior
from .timing import time_calls


def jax_routing(t, e, k, routing, seed):
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    experts = jax.lax.top_k(log_prior(e, routing, jnp) + jax.random.gumbel(k1, (t, e)), k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(k2, (t, k)), axis=-1)
    return weights, experts


def jax_variant(moe, variant, top_k):
    """The timed forward `f(x, r1, r2, gu, d)` of `variant`. `plain`: moe itself, (r1, r2) = (weights, experts).
    `remat`: the same under jax.checkpoint. `router`: (r1, r2) = (w_router [H, E], logit_bias [E]), routed inside by
    jax_megamoe.route (what every JAX implementation here would call), so r1 gets the router's gradient."""
    import jax
    import jax.numpy as jnp

    if variant == "plain":
        return moe
    if variant == "remat":
        return jax.checkpoint(moe)
    if variant == "router":
        from jax_megamoe import route

        def routed(x, w_router, logit_bias, gu, d):
            logits = jnp.dot(x, w_router, preferred_element_type=jnp.float32) + logit_bias
            weights, experts = route(logits, top_k, norm_topk_prob=True)
            return moe(x, weights, experts, gu, d)

        return routed
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")


def jax_impl(name, shape=None):
    """The MoE function of implementation `name`; `shape` (T, H, I, E, K) gives `ours_tiles_*` their config."""
    import jax
    import jax.numpy as jnp

    if name == FP8_IMPL:
        import jax_megamoe as jmm

        return lambda x, w, ids, gu, d: jmm.moe_ffn(x, w, ids, gu, d, implementation="cuda", recipe="fp8_blockwise")
    if name in ("ours", GRAPHS_IMPL) or is_tiles_impl(name):
        import jax_megamoe as jmm  # graphs come from XLA_FLAGS, set for the child by child_env()

        config = gemm_config(name, shape)
        return lambda x, w, ids, gu, d: jmm.moe_ffn(x, w, ids, gu, d, implementation="cuda", gemm_config=config)

    from jax_megamoe.reference import swiglu

    if name in ("ragged_dot", "tokamax"):
        if name == "tokamax":
            import tokamax

            def ragged(a, b, s):
                return tokamax.ragged_dot(a, b, s, implementation="mosaic")
        else:
            ragged = jax.lax.ragged_dot

        def moe(x, w, ids, gu, d):
            t, k = ids.shape
            e = gu.shape[0]
            flat = ids.reshape(-1)
            order = jnp.argsort(flat, stable=True)
            sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
            xs = x[order // k]
            out = ragged(swiglu(ragged(xs, gu, sizes)), d, sizes)
            out = out.astype(jnp.float32) * w.reshape(-1)[order][:, None]
            return jnp.zeros((t, x.shape[1]), jnp.float32).at[order // k].add(out).astype(x.dtype)

        return moe

    if name == "gshard":

        def moe(x, w, ids, gu, d):
            t, k = ids.shape
            e = gu.shape[0]
            cap = math.ceil(t * k / e)  # capacity factor 1.0
            onehot = jax.nn.one_hot(ids, e, dtype=jnp.int32)  # [T, K, E]
            pos = jnp.cumsum(onehot.reshape(t * k, e), axis=0).reshape(t, k, e) - 1
            pos = jnp.sum(pos * onehot, axis=-1)  # [T, K]
            keep = (pos < cap).astype(x.dtype)
            dispatch = sum(
                jax.nn.one_hot(ids[:, j], e, dtype=x.dtype)[:, :, None]
                * (jax.nn.one_hot(pos[:, j], cap, dtype=x.dtype) * keep[:, j, None])[:, None, :]
                for j in range(k)
            )  # [T, E, C]
            combine = sum(
                jax.nn.one_hot(ids[:, j], e, dtype=x.dtype)[:, :, None]
                * (jax.nn.one_hot(pos[:, j], cap, dtype=x.dtype) * (keep[:, j] * w[:, j]).astype(x.dtype)[:, None])[
                    :, None, :
                ]
                for j in range(k)
            )
            xe = jnp.einsum("tec,th->ech", dispatch, x)
            he = swiglu(jnp.einsum("ech,ehi->eci", xe, gu))
            oe = jnp.einsum("eci,eih->ech", he, d)
            return jnp.einsum("tec,ech->th", combine, oe)

        return moe
    raise ValueError(name)


def forward_and_gradients(moe):
    """`(y, gradients)` of `moe` for (x, r1, gu, d): y is returned because a training step uses it, and a jitted
    gradient alone would let XLA drop the first forward of `remat` (nothing of it is saved) and time one."""
    import jax

    def fwd_bwd(x, r1, r2, gu, d, dy):
        y, vjp = jax.vjp(lambda a, b, c, f: moe(a, b, r2, c, f), x, r1, gu, d)
        return y, vjp(dy)

    return fwd_bwd


def run_jax(name, cname, routing, variant, samples, inner):
    import jax
    import jax.numpy as jnp

    row = dict(impl=name, config=cname, routing=routing, variant=variant)
    if name == "tokamax":
        benchmarks.add_peer_site(os.environ.get("JMM_PEER_SITE"))
        # tokamax's absl flags parse sys.argv and refuse this child's own (already parsed) arguments.
        sys.argv = sys.argv[:1]
        try:
            import tokamax  # noqa: F401
        except Exception as err:  # noqa: BLE001 - any import failure means the peer is unavailable
            return dict(row, status=f"skipped: tokamax not importable ({err!r})")
    t, h, i, e, k = CONFIGS[cname]
    moe = jax_variant(jax_impl(name, CONFIGS[cname]), variant, k)

    def peak_bytes():  # without memory statistics (a CPU) the peak is NaN
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", float("nan"))

    try:
        keys = jax.random.split(jax.random.PRNGKey(7), 5)
        x = jax.random.normal(keys[0], (t, h), jnp.bfloat16)
        gu = (jax.random.normal(keys[1], (e, h, 2 * i), jnp.bfloat16) / math.sqrt(h)).astype(jnp.bfloat16)
        d = (jax.random.normal(keys[2], (e, i, h), jnp.bfloat16) / math.sqrt(i)).astype(jnp.bfloat16)
        dy = jax.random.normal(keys[3], (t, h), jnp.bfloat16)
        if variant == "router":
            r1 = (jax.random.normal(keys[4], (h, e), jnp.bfloat16) / math.sqrt(h)).astype(jnp.bfloat16)
            r2 = log_prior(e, routing, jnp)
        else:
            r1, r2 = jax_routing(t, e, k, routing, seed=11)
        # The experts this row's routing touches (for `router`, the top-k of its logits: its routed ids).
        ids = r2 if variant != "router" else jax.lax.top_k(x.astype(jnp.float32) @ r1.astype(jnp.float32) + r2, k)[1]
        row["experts_touched"] = int(jnp.unique(ids).size)
        sync = jax.block_until_ready
        fwd = jax.jit(moe)
        fwd_bwd = jax.jit(forward_and_gradients(moe)).lower(x, r1, r2, gu, d, dy).compile()
        before = peak_bytes()
        sync(fwd_bwd(x, r1, r2, gu, d, dy))
        peak = peak_bytes()
        row.update(peak_gib=peak / 2**30, peak_by_call=bool(peak > before) if math.isfinite(peak) else None)
        row["fwd_ms"], row["fwd_min_ms"] = time_calls(fwd, (x, r1, r2, gu, d), sync, samples, inner)
        row["fwd_bwd_ms"], row["fwd_bwd_min_ms"] = time_calls(fwd_bwd, (x, r1, r2, gu, d, dy), sync, samples, inner)
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - OOM and compile failures are results here
        msg = str(err).splitlines()[0][:200]
        row["status"] = (
            "OOM: " if "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower() else "error: "
        ) + msg
    return row
