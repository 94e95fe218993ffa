"""The MoE layer on CPU: jax_megamoe's C++ kernels (`implementation="cpu"`, what `"auto"` runs on a CPU) against
the pure-JAX reference (`implementation="reference"`), in one process.

Shapes: the tiny preset's MoE widths (H = 64, I = 32, E = 8, K = 2; --hidden --inter --experts --top-k for others)
at each of --tokens T, in each of --dtypes; uniform routing (each token's K distinct experts drawn at random),
routing weights a softmax over K normals, router excluded.
Timing: forward (y) and forward+backward (y and the gradients of x, the routing weights, w_gate_up and w_down),
each one jitted call; after --warmup calls each, --samples samples of one synchronised call, the implementations
taking turns sample by sample so that both see the same machine; the figure is the median sample. The process
uses every core JAX sees (XLA's thread pool for the reference's matmuls and the kernels' work items alike).
Usage: python -m benchmarks.bench_moe_cpu [--tokens 1024,4096,16384] [--dtypes float32,bfloat16] [--samples 30]
                                          [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks import comma_list
from jax_megamoe import cli  # the command-line jobs' exit-code rule

IMPLS = ("cpu", "reference")
DTYPES = ("float32", "bfloat16")


def comma_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def problem(tokens, hidden, inter, experts, top_k, dtype, seed=0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]  # K distinct experts per token
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (tokens, hidden), dtype)
    weights = jax.nn.softmax(jax.random.normal(keys[1], (tokens, top_k)), axis=-1)
    w_gate_up = (jax.random.normal(keys[2], (experts, hidden, 2 * inter)) / hidden**0.5).astype(dtype)
    w_down = (jax.random.normal(keys[3], (experts, inter, hidden)) / inter**0.5).astype(dtype)
    return x, weights, jnp.asarray(ids, jnp.int32), w_gate_up, w_down


def functions(implementation):
    """The jitted forward and forward+backward of `moe_ffn` on `implementation`."""
    import jax
    import jax.numpy as jnp

    import jax_megamoe as jmm

    def forward(x, weights, experts, w_gate_up, w_down):
        return jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, implementation=implementation)

    def loss(x, weights, experts, w_gate_up, w_down):
        return forward(x, weights, experts, w_gate_up, w_down).astype(jnp.float32).sum()

    return {
        "fwd": jax.jit(forward),
        "fwd_bwd": jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 3, 4))),
    }


def time_in_turns(calls: dict, args, warmup: int, samples: int) -> dict[str, float]:
    """The median ms of one synchronised call of each of `calls`, sampled in turns."""
    import jax

    for fn in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(samples):
        for name, fn in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def table(rows) -> str:
    lines = [
        "| dtype | T | cpu fwd | reference fwd | cpu fwd+bwd | reference fwd+bwd |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [f"{row[f'{impl}_{kind}_ms']:.3g}" for kind in ("fwd", "fwd_bwd") for impl in IMPLS]
        lines.append(f"| {row['dtype']} | {row['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=comma_ints, default=[1024, 4096, 16384])
    parser.add_argument("--dtypes", type=comma_list(DTYPES), default=list(DTYPES))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--inter", type=int, default=32)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not 0 < args.top_k <= args.experts:
        parser.error(f"--top-k must lie in [1, --experts], got {args.top_k} with --experts {args.experts}")

    import jax

    if jax.default_backend() != "cpu":
        raise cli.UsageError(f"this benchmark times the CPU kernels; JAX's backend is {jax.default_backend()!r}")
    calls = {f"{impl}_{kind}": fn for impl in IMPLS for kind, fn in functions(impl).items()}
    rows = []
    for dtype in args.dtypes:
        for tokens in args.tokens:
            args_ = problem(tokens, args.hidden, args.inter, args.experts, args.top_k, dtype)
            medians = time_in_turns(calls, args_, args.warmup, args.samples)
            row = dict(dtype=dtype, tokens=tokens, **{f"{name}_ms": ms for name, ms in medians.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table(rows))
    if args.json:
        shape = dict(hidden=args.hidden, inter=args.inter, experts=args.experts, top_k=args.top_k)
        info = dict(shape=shape, samples=args.samples, cores=os.cpu_count(), jax=jax.__version__, argv=sys.argv)
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, **info), f, indent=1)
    return rows


if __name__ == "__main__":
    cli.run(main)
