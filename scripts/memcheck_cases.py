"""Small CUDA cases for compute-sanitizer (scripts/gpu_check.sh, step memcheck).

`moe_ffn` forward and backward on the CUDA kernels: bf16 at tensor-core and at unaligned sizes, float32,
and expert ids outside [0, E) (dropped pairs); then `moe_ffn_ep` over the nvlink transport with two
emulated shards on this GPU, forward and backward. Every result must be finite; the sanitizer reports
any out-of-bounds or uninitialised access of the kernels on the way.

    compute-sanitizer --tool memcheck --error-exitcode 7 python scripts/memcheck_cases.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_megamoe as jmm


def check_finite(*values) -> None:
    for value in values:
        assert np.isfinite(np.asarray(value, np.float32)).all()


def moe_ffn_cases() -> None:
    for t, h, i, e, k, dtype in [
        (37, 64, 32, 5, 2, jnp.bfloat16),
        (19, 20, 12, 3, 3, jnp.float32),
        (40, 24, 16, 4, 2, jnp.bfloat16),
    ]:
        keys = jax.random.split(jax.random.key(t), 5)
        x = jax.random.normal(keys[0], (t, h)).astype(dtype)
        experts = jax.random.randint(keys[1], (t, k), -1, e + 1)  # -1 and e are dropped
        weights = jax.random.uniform(keys[2], (t, k))
        w_gate_up = (jax.random.normal(keys[3], (e, h, 2 * i)) * 0.1).astype(dtype)
        w_down = (jax.random.normal(keys[4], (e, i, h)) * 0.1).astype(dtype)

        def loss(x, weights, w_gate_up, w_down, experts=experts):
            y = jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, implementation="cuda")
            return y.astype(jnp.float32).sum()

        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, weights, w_gate_up, w_down)
        check_finite(value, *grads)
        print("memcheck case moe_ffn", (t, h, i, e, k, jnp.dtype(dtype).name), "ok", flush=True)


def nvlink_emulated_case(ranks: int = 2) -> None:
    t, h, i, e, k = 24, 40, 16, 8, 2
    keys = jax.random.split(jax.random.key(1), 5)
    experts = jax.random.randint(keys[0], (ranks, t, k), 0, e)
    weights = jax.random.uniform(keys[1], (ranks, t, k))
    x = jax.random.normal(keys[2], (ranks, t, h), jnp.bfloat16)
    w_gate_up = (jax.random.normal(keys[3], (ranks, e // ranks, h, 2 * i)) * 0.1).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[4], (ranks, e // ranks, i, h)) * 0.1).astype(jnp.bfloat16)
    with jmm.NvlinkWorkspace.emulated(ranks, max_tokens=t, hidden=h, top_k=k) as workspace:
        ep = jax.vmap(functools.partial(jmm.moe_ffn_ep, transport=jmm.NvlinkTransport(workspace)), axis_name="expert")

        def loss(x, weights, w_gate_up, w_down):
            return ep(x, weights, experts, w_gate_up, w_down).astype(jnp.float32).sum()

        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, weights, w_gate_up, w_down)
        check_finite(value, *grads)
    print(f"memcheck case nvlink emulated R={ranks} ok", flush=True)


if __name__ == "__main__":
    moe_ffn_cases()
    nvlink_emulated_case()
