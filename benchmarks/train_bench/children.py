"""One subprocess per stack (so each one's peak memory is its own): the child's command line and environment, and
the row it prints as one tagged JSON line."""

from __future__ import annotations

import json
import os
import subprocess

import benchmarks

from .jax_stack import run_jax
from .matmul import run_matmul
from .torch_stack import run_torch

ROW_TAG = "JMM_TRAIN_ROW "


def child(args) -> None:
    """One stack's row (or the matmul rate) as a tagged JSON line on stdout, for the driver."""
    if args.child == "matmul":
        row = run_matmul(args)
    elif args.child == "torch":
        row = run_torch(args)
    else:
        row = run_jax(args.child, args)
    print(ROW_TAG + json.dumps(row), flush=True)


def child_arguments(args, name: str) -> list[str]:
    """The command line of `name`'s child, `python -m benchmarks.bench_train ARGS` (run from the repository root,
    so its paths are absolute)."""
    cmd = [
        "--child",
        name,
        "--preset",
        args.preset,
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--param-dtype",
        args.param_dtype,
        "--seed",
        str(args.seed),
        "--breakdown",
        ",".join(args.breakdown) or "none",
    ]
    if args.peer_site:
        cmd += ["--peer-site", os.path.abspath(args.peer_site)]
    if args.profile:
        cmd += ["--profile", os.path.abspath(args.profile)]
    if args.matmul_size:
        cmd += ["--matmul-size", str(args.matmul_size)]
    return cmd


def child_env() -> dict:
    env = dict(os.environ)
    # The breakdown's variants run beside the step's state; JAX's default pool (75% of the GPU) can be short.
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_child(args, name: str, timeout: float) -> dict:
    """`child` in a subprocess of its own: its row, or a row saying how it ended."""
    try:
        row, crash = benchmarks.run_child(
            "benchmarks.bench_train",
            child_arguments(args, name),
            ROW_TAG,
            env=child_env(),
            timeout=timeout,
            tail_chars=400,
        )
    except subprocess.TimeoutExpired:
        return dict(status=f"timed out after {timeout:.0f} s")
    return row if row is not None else dict(status=crash)
