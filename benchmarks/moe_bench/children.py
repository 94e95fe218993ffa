"""One subprocess per row (so each one's peak memory is its own): the child's environment, and the row it prints
as one tagged JSON line."""

from __future__ import annotations

import json
import os

import benchmarks

from .device_rates import BANDWIDTH_ROW, MATMUL_ROW, run_matmul, run_read_bandwidth
from .impls import GRAPH_XLA_FLAGS, GRAPHS_IMPL
from .jax_impls import run_jax
from .torch_impls import TORCH_IMPLS, run_torch

ROW_TAG = "JMM_BENCH_ROW "


def child(args):
    """One row (one config and routing given), or one of the device's rates, printed as JSON for the driver."""
    if args.child == MATMUL_ROW:
        row = run_matmul()
    elif args.child == BANDWIDTH_ROW:
        row = run_read_bandwidth()
    elif args.child in TORCH_IMPLS:
        row = run_torch(args.child, args.configs, args.routings, args.variants, args.samples, args.inner)
    else:
        row = run_jax(args.child, args.configs, args.routings, args.variants, args.samples, args.inner)
    print(ROW_TAG + json.dumps(row))


def child_env(impl):
    """The environment of `impl`'s subprocess: this one's, plus GRAPH_XLA_FLAGS in XLA_FLAGS for `ours_graphs`
    (XLA reads them when its GPU client starts, so they cannot be set from inside the child)."""
    env = dict(os.environ)
    if impl == GRAPHS_IMPL:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + GRAPH_XLA_FLAGS).strip()
    return env


def run_child(impl, cname="all", routing="all", variant="all", samples=0, inner=0):
    """`child` in a subprocess of its own: its row, or a row saying how it crashed."""
    args = ["--child", impl, "--configs", cname, "--routings", routing, "--variants", variant]
    args += ["--samples", str(samples), "--inner", str(inner)]
    row, crash = benchmarks.run_child("benchmarks.bench_moe", args, ROW_TAG, env=child_env(impl))
    return row if row is not None else dict(impl=impl, config=cname, routing=routing, variant=variant, status=crash)
