"""The device's own rates, each measured in a child of its own in the same run as the rows: the bf16 matmul rate,
the base of every row's "%mm", and the read bandwidth, the base of the decode rows' floors."""

from __future__ import annotations

from .timing import time_calls

MATMUL_ROW = "bf16_matmul_8192"  # the driver's child that measures the bf16 matmul rate
BANDWIDTH_ROW = "read_bandwidth"  # the driver's child that measures the GPU's read bandwidth


def run_matmul():
    """The bf16 matmul rate (8192^3, torch) of this GPU, the base of every row's "%mm"."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms, _ = time_calls(torch.matmul, (a, b), lambda _: torch.cuda.synchronize(), 10, 10)
    return dict(impl=MATMUL_ROW, status="ok", tflops=2 * 8192**3 / mm_ms / 1e9, ms=mm_ms)


def run_read_bandwidth():
    """The device's read bandwidth: a float32 sum over a bf16 buffer (JAX; 4 GiB on a GPU, 256 MiB on a CPU,
    where it only keeps the smoke tests small), the base of every decode row's floor."""
    import jax
    import jax.numpy as jnp

    elements = 1 << (31 if jax.devices()[0].platform == "gpu" else 27)
    a = jnp.ones((elements,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    ms, _ = time_calls(total, (a,), jax.block_until_ready, 10, 10)
    return dict(impl=BANDWIDTH_ROW, status="ok", gb_per_s=a.nbytes / ms / 1e6, ms=ms, bytes=a.nbytes)
