"""The GPUs a test process may use, counted without starting JAX: a JAX client here would take memory on every
GPU, which the tests that hand GPUs to subprocesses (training runs, `jax.distributed` workers) need free."""

from __future__ import annotations

import functools
import os
import subprocess


@functools.cache
def visible_gpus() -> tuple[str, ...]:
    """The CUDA_VISIBLE_DEVICES entries of the GPUs this process may use: `nvidia-smi -L`'s GPUs, narrowed to
    CUDA_VISIBLE_DEVICES where it is set; none without nvidia-smi."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if listing.returncode != 0:
        return ()
    count = sum(line.startswith("GPU ") for line in listing.stdout.splitlines())
    restricted = os.environ.get("CUDA_VISIBLE_DEVICES")
    if restricted is not None:
        return tuple(entry.strip() for entry in restricted.split(",") if entry.strip())[:count]
    return tuple(str(index) for index in range(count))
