"""Deadlock test: MoE forward+backward through `moe_ffn_ep` while large XLA/NCCL collectives run in the same step.

One jitted `shard_map` step over every local device (mesh axis "expert") does two independent things, so
XLA may run them concurrently:
  * MoE forward and backward (all four gradients) with `moe_ffn_ep(transport=--transport)` (bf16, a
    bench_ep config, T tokens per device; `nvlink` opens an `NvlinkWorkspace` for the mesh and passes
    `NvlinkTransport(workspace)`, whose fused calls push the rows by the copy engines, as bench_ep.py does);
  * the FSDP pattern: an all_gather of a `--collective-mib` MiB float32 shard per device and a
    psum_scatter of a buffer of that many MiB per device times the axis size (the next step's shard).
The collective buffers start at 1.0 and stay exactly 1.0 (psum_scatter is divided by the axis size).

Each iteration is dispatched and waited for alone; a watchdog thread aborts the process (exit 3, JSON
written with hangs=1) if one iteration takes longer than `--hang-seconds`. After the run it checks the
collective buffers are still all 1.0 and that every iteration's MoE checksum (per-device integer sum of the
bits of the output and gradients) equals the first's (moe_ffn_ep is deterministic), so data corrupted by a race
under concurrency fails the run (exit 1) instead of passing silently.

NCCL settings are read when JAX starts, so this script sets them before importing JAX: `--nccl-max-ctas N`
sets NCCL_MAX_CTAS (left as in the environment otherwise), and NCCL_NVLS_ENABLE=0 always (NVLink multicast
stays off). The JSON records the NCCL_* environment actually used.

Usage: python -m benchmarks.nccl_concurrency OUT.json [--transport nvlink|xla|ragged] [--iters 1000]
         [--collective-mib 1024] [--hang-seconds 60] [--nccl-max-ctas N] [--config q30]
CPU smoke: JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
         python -m benchmarks.nccl_concurrency out.json --transport xla --iters 3 --collective-mib 1 --config tiny
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import threading
import time

from jax_megamoe import cli  # the command-line jobs' exit-code rule

EXIT_HANG = 3


def parse_args(argv=None) -> argparse.Namespace:
    parser = cli.Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_path", help="where to write the result (JSON)")
    parser.add_argument("--transport", default="nvlink", choices=("nvlink", "xla", "ragged"))
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument(
        "--collective-mib",
        type=float,
        default=1024.0,
        help="MiB per device of the all_gather input and of the psum_scatter output",
    )
    parser.add_argument(
        "--hang-seconds", type=float, default=60.0, help="abort (exit 3) if one iteration takes longer than this"
    )
    parser.add_argument(
        "--nccl-max-ctas",
        type=int,
        default=None,
        help="set NCCL_MAX_CTAS (before JAX starts); default: leave the environment as is",
    )
    parser.add_argument("--config", default="q30", help="bench_ep config of the MoE layer (q30, q30s, tiny)")
    opts = parser.parse_args(argv)
    for name in ("iters", "collective_mib", "hang_seconds"):
        if not getattr(opts, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(opts, name)}")
    if opts.nccl_max_ctas is not None and opts.nccl_max_ctas <= 0:
        parser.error(f"--nccl-max-ctas must be > 0, got {opts.nccl_max_ctas}")
    return opts


def set_nccl_env(opts) -> None:
    """NCCL reads these when the first communicator is made, so they must be set before JAX starts."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # never NVLink multicast: not every NVLink system offers it
    if opts.nccl_max_ctas is not None:
        os.environ["NCCL_MAX_CTAS"] = str(opts.nccl_max_ctas)


def recorded_env() -> dict:
    return {
        k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "XLA_", "JAX_", "CUDA_VISIBLE", "JMM_"))
    }


class Watchdog:
    """A daemon thread that calls `on_hang(iteration, seconds)` then ends the process (exit 3) when the
    iteration armed by `arm` has not been disarmed within `limit_s` seconds."""

    def __init__(self, limit_s: float, on_hang):
        self.limit_s, self.on_hang = limit_s, on_hang
        self._lock = threading.Lock()
        self._armed: tuple[int, float] | None = None  # (iteration, start time)
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, iteration: int) -> None:
        with self._lock:
            self._armed = (iteration, time.monotonic())

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit_s / 10))
            with self._lock:
                armed = self._armed
            if armed is not None and time.monotonic() - armed[1] > self.limit_s:
                self.on_hang(*armed)
                # The main thread is stuck inside the runtime: only an immediate exit ends the process.
                os._exit(EXIT_HANG)


def build_step(mesh, moe_options):
    """The jitted step `(moe_args, dy, shard, full) -> (checksum [ep], next_shard, next_full)`."""
    import jax  # imported here, not at the top: JAX must start after set_nccl_env
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_megamoe as jmm

    ep = mesh.size

    def bit_sum(t):
        # A wrapping integer sum of the raw bits: any changed bit shows, and the order of the sum cannot
        # matter (a float sum might differ run to run if XLA ever reduced in another order).
        bits = jax.lax.bitcast_convert_type(t, jnp.uint16 if t.dtype.itemsize == 2 else jnp.uint32)
        return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)

    def per_device(x, weights, ids, w_gate_up, w_down, dy, shard, full):
        def moe(a, w, g, d):
            return jmm.moe_ffn_ep(a, w, ids, g, d, axis_name="expert", **moe_options)

        y, vjp = jax.vjp(moe, x, weights, w_gate_up, w_down)
        checksum = sum(bit_sum(t) for t in (y, *vjp(dy)))
        # FSDP pattern, independent of the MoE data: gather the parameter shard, reduce-scatter the gradient.
        next_full = jax.lax.all_gather(shard, "expert", tiled=True)
        next_shard = jax.lax.psum_scatter(full, "expert", tiled=True) / ep
        return checksum[None], next_shard, next_full

    spec = P("expert")
    step = jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 8, out_specs=(spec,) * 3)
    return jax.jit(step, donate_argnums=(6, 7))


def main(argv=None) -> int:
    opts = parse_args(argv)
    set_nccl_env(opts)

    # JAX (and through it NCCL) is imported only now, after the environment is final.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_megamoe as jmm
    from benchmarks.bench_ep import CONFIGS, ep_options, git_commit, make_inputs

    if opts.config not in CONFIGS:
        raise cli.UsageError(f"--config must be one of {sorted(CONFIGS)}, got {opts.config!r}")
    tokens, hidden, inter, experts, top_k = CONFIGS[opts.config]
    devices = jax.local_devices()
    mesh = Mesh(np.array(devices), ("expert",))
    ep = mesh.size
    if experts % ep:
        raise cli.UsageError(
            f"--config {opts.config} has {experts} experts, not divisible by the {ep} local devices: pass another "
            "--config"
        )
    collective_elems = max(1, int(opts.collective_mib * 2**20) // 4)  # float32 per device

    result = {
        "benchmark": "NCCL concurrency: moe_ffn_ep fwd+bwd with FSDP all_gather/psum_scatter in the same step",
        "transport": opts.transport,
        "devices": ep,
        "device_kind": devices[0].device_kind,
        "jax": jax.__version__,
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": dict(
            zip(("tokens_per_device", "hidden", "inter", "experts", "top_k"), CONFIGS[opts.config], strict=True),
            name=opts.config,
            dtype="bfloat16",
        ),
        "collective_mib_per_device": opts.collective_mib,
        "iterations_requested": opts.iters,
        "hang_seconds": opts.hang_seconds,
        "env": recorded_env(),
        "iterations_done": 0,
        "hangs": 0,
        "checksum_mismatches": 0,
        "collectives_exact": None,
    }
    iteration_ms: list[float] = []

    def write_result():
        if iteration_ms:
            result["time_per_iteration_ms"] = {
                "median": statistics.median(iteration_ms),
                "mean": statistics.fmean(iteration_ms),
                "min": min(iteration_ms),
                "max": max(iteration_ms),
            }
        with open(opts.json_path, "w") as f:
            json.dump(result, f, indent=2)

    def on_hang(iteration, start):
        seconds = time.monotonic() - start
        result.update(hangs=1, hung_iteration=iteration, hung_after_s=round(seconds, 1))
        write_result()
        print(
            f"HANG: iteration {iteration} did not finish within {opts.hang_seconds:g} s (transport "
            f"{opts.transport}, NCCL_MAX_CTAS={os.environ.get('NCCL_MAX_CTAS', 'unset')}); aborting. "
            f"{result['iterations_done']} iterations completed; wrote {opts.json_path}",
            file=sys.stderr,
            flush=True,
        )

    sharding = NamedSharding(mesh, P("expert"))
    args, dy = make_inputs(tokens * ep, hidden, inter, experts, top_k, "uniform")
    args = tuple(jax.device_put(a, sharding) for a in args)
    dy = jax.device_put(dy, sharding)
    # Made on the devices directly (a 1 GiB-per-device buffer must not pass through one device).
    shard = jax.jit(lambda: jnp.ones((ep * collective_elems,), jnp.float32), out_shardings=sharding)()
    full = jax.jit(lambda: jnp.ones((ep * ep * collective_elems,), jnp.float32), out_shardings=sharding)()

    open_workspace = functools.partial(
        jmm.NvlinkWorkspace, mesh, axis_name="expert", max_tokens=tokens, hidden=hidden, top_k=top_k, dtype=jnp.bfloat16
    )
    with ep_options(opts.transport, open_workspace) as moe_options:
        step = build_step(mesh, moe_options)
        print(
            f"compiling: transport {opts.transport}, {ep} devices, config {opts.config}, "
            f"{opts.collective_mib:g} MiB collectives per device",
            flush=True,
        )
        compiled = step.lower(*args, dy, shard, full).compile()
        watchdog = Watchdog(opts.hang_seconds, on_hang)
        first_checksum = None
        for iteration in range(opts.iters):
            watchdog.arm(iteration)
            start = time.perf_counter()
            checksum, shard, full = compiled(*args, dy, shard, full)
            jax.block_until_ready((checksum, shard, full))
            iteration_ms.append((time.perf_counter() - start) * 1e3)
            watchdog.disarm()
            checksum = np.asarray(checksum)
            if first_checksum is None:
                first_checksum = checksum
            elif not np.array_equal(checksum, first_checksum):
                result["checksum_mismatches"] += 1
            result["iterations_done"] = iteration + 1
            if (iteration + 1) % max(1, opts.iters // 10) == 0:
                print(f"iteration {iteration + 1}/{opts.iters}: {iteration_ms[-1]:.2f} ms", flush=True)
    result["collectives_exact"] = bool(jnp.all(shard == 1.0)) and bool(jnp.all(full == 1.0))
    result["ok"] = result["checksum_mismatches"] == 0 and result["collectives_exact"]
    write_result()
    timing = result["time_per_iteration_ms"]
    print(
        f"{result['iterations_done']} iterations, 0 hangs, median {timing['median']:.2f} ms "
        f"(max {timing['max']:.2f} ms); checksum mismatches {result['checksum_mismatches']}, collectives exact: "
        f"{result['collectives_exact']}; wrote {opts.json_path}",
        flush=True,
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
