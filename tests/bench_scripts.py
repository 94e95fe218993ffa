"""Runs a benchmark script for the tests of its plumbing, the way `python -m benchmarks.NAME` runs it from the
repository root: in a fresh process on host CPU devices, its output captured (their GPU numbers come from
scripts/bench.sh)."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks import ROOT


def cpu_env(devices: int) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop("NCCL_MAX_CTAS", None)
    return env


def run_script(name: str, *args: str, devices: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """benchmarks/`name` with `args` in a fresh process on `devices` host devices, run as the module
    `benchmarks.NAME` from the repository root; its output captured."""
    command = [sys.executable, "-m", f"benchmarks.{name.removesuffix('.py')}", *args]
    return subprocess.run(command, cwd=ROOT, env=cpu_env(devices), capture_output=True, text=True, timeout=timeout)
