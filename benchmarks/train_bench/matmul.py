"""The device's bf16 matmul rate, measured in the same run: the MFU denominator."""

from __future__ import annotations

import statistics
import time


def run_matmul(args) -> dict:
    """The bf16 matmul rate of this device (torch on a GPU, JAX elsewhere), the MFU denominator."""

    def median_call_ms(fn, sync, samples=10, inner=10):
        for _ in range(3):
            sync(fn())
        times = []
        for _ in range(samples):
            began = time.perf_counter()
            for _ in range(inner):
                out = fn()
            sync(out)
            times.append((time.perf_counter() - began) * 1e3 / inner)
        return statistics.median(times)

    try:
        import torch

        use_torch = torch.cuda.is_available()
    except ImportError:
        use_torch = False
    if use_torch:
        size = args.matmul_size or 8192
        a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        ms = median_call_ms(lambda: a @ b, lambda _: torch.cuda.synchronize())
        library, device = "torch", torch.cuda.get_device_name()
    else:
        import jax
        import jax.numpy as jnp

        on_gpu = jax.default_backend() == "gpu"
        size = args.matmul_size or (8192 if on_gpu else 512)  # bf16 on a CPU: 8192^3 would take minutes
        keys = jax.random.split(jax.random.PRNGKey(0))
        x = jax.random.normal(keys[0], (size, size), jnp.bfloat16)
        y = jax.random.normal(keys[1], (size, size), jnp.bfloat16)
        mm = jax.jit(jnp.dot)
        ms = median_call_ms(lambda: mm(x, y), jax.block_until_ready)
        library, device = "jax", jax.devices()[0].device_kind
    return dict(status="ok", size=size, library=library, device=device, ms=ms, tflops=2 * size**3 / ms / 1e9)
