"""One process of the multi-process `moe_ffn_ep` check (run by tests/test_ep_multiprocess_gpu.py).

Every process joins `jax.distributed`, builds the same gathered problem from the same seed, and runs
`moe_ffn_ep` under `shard_map` on a global mesh ("expert" axis over every process's devices), forward and
the gradients in x, weights, w_gate_up and w_down. It checks the shards it holds against the float32
reference on the gathered problem (normwise relative error per shard), prints one line per check and
exits 1 if any check failed. Runs on GPUs (one per process, chosen by the parent through
CUDA_VISIBLE_DEVICES) and on CPUs (JAX_PLATFORMS=cpu, one host device per process, gloo collectives).

Usage: python tests/ep_multiprocess_worker.py --process-id I --num-processes N --coordinator HOST:PORT
         [--transports xla] [--dtypes float32,bfloat16] [--routings uniform,zipf,all_to_one]
Transports are moe_ffn_ep's: "xla", "ragged", and "nvlink" (an NvlinkTransport over a workspace made by every
process): its fused calls run where they apply (bf16 here, which the worker checks in the program), float32
falls back to "xla".
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from moe_cases import Case, make_problem, rel_error

import jax_megamoe as jmm
from jax_megamoe import reference

TOKENS_PER_SHARD, HIDDEN, INTER, EXPERTS, TOP_K = 64, 64, 32, 8, 2
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # normwise, against the float32 reference
OUTPUT_NAMES = ("y", "dx", "d_weights", "d_w_gate_up", "d_w_down")
# The nvlink transport's fused FFI targets.
FUSED_CALLS = ("jmm_cuda_nvlink_moe_gate_up", "jmm_cuda_nvlink_moe_down", "jmm_cuda_nvlink_moe_backward")


def gathered_problem(routing: str, dtype, tokens: int):
    """The whole problem as numpy arrays `(x, weights, ids, w_gate_up, w_down), dy`, equal in every process.

    `all_to_one` sends every pair to the last shard's experts (ids E-1, E-2, ...), the worst imbalance.
    """
    args, dy = make_problem(Case(tokens, HIDDEN, INTER, EXPERTS, TOP_K, routing), dtype, seed="ep_multiprocess")
    return tuple(np.asarray(a) for a in args), np.asarray(dy.astype(jnp.float32))


def value_and_grads(fn, args, dy):
    """`fn(*args)` and the gradients of `<fn(*args), dy>` in x, weights, w_gate_up, w_down."""

    def loss(x, weights, w_gate_up, w_down):
        y = fn(x, weights, args[2], w_gate_up, w_down)
        return jnp.sum(y.astype(jnp.float32) * dy), y

    grads, y = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(args[0], args[1], args[3], args[4])
    return (y, *grads)


@functools.cache  # one compile per transport and dtype: every routing has the same shapes
def ep_value_and_grads(mesh: Mesh, transport: str, dtype_name: str):
    """Jitted forward and gradients of `moe_ffn_ep` over the global mesh (everything sharded over "expert").

    The nvlink transport gets one workspace per dtype, made by every process in the same order.
    """
    options = dict(axis_name="expert", transport=transport, num_experts=EXPERTS)
    if transport == "nvlink":
        options["transport"] = jmm.NvlinkTransport(
            jmm.NvlinkWorkspace(
                mesh, "expert", max_tokens=TOKENS_PER_SHARD, hidden=HIDDEN, top_k=TOP_K, dtype=jnp.dtype(dtype_name)
            )
        )
    spec = P("expert")
    fn = jax.shard_map(functools.partial(jmm.moe_ffn_ep, **options), mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    return jax.jit(functools.partial(value_and_grads, fn))


@functools.cache
def reference_value_and_grads():
    return jax.jit(functools.partial(value_and_grads, reference.moe_ffn))


def to_global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from the full host copy every process holds (each process supplies its shards)."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def check(mesh: Mesh, transport: str, dtype_name: str, routing: str) -> bool:
    """Runs one case; prints one line per output shard held here; True if all are within tolerance."""
    tokens = TOKENS_PER_SHARD * mesh.size
    args, dy = gathered_problem(routing, jnp.dtype(dtype_name), tokens)
    sharding = NamedSharding(mesh, P("expert"))
    fn = ep_value_and_grads(mesh, transport, dtype_name)
    global_args, global_dy = tuple(to_global(a, sharding) for a in args), to_global(dy, sharding)
    got = fn(global_args, global_dy)
    ok = True
    if transport == "nvlink" and dtype_name == "bfloat16":  # the fused calls apply: they must be in the program
        text = fn.lower(global_args, global_dy).as_text()
        missing = [target for target in FUSED_CALLS if target not in text]
        if missing:
            print(
                f"FAIL process {jax.process_index()} nvlink bfloat16 {routing}: the program lacks {missing}", flush=True
            )
            ok = False

    args32 = tuple(a.astype(np.float32) if a.dtype != np.int32 else a for a in args)
    on_local_device = functools.partial(jax.device_put, device=jax.local_devices()[0])
    expected = reference_value_and_grads()(on_local_device(args32), on_local_device(dy))
    for name, result, want in zip(OUTPUT_NAMES, got, expected, strict=True):
        want = np.asarray(want)
        if result.shape != want.shape:
            print(f"FAIL {transport} {dtype_name} {routing} {name}: shape {result.shape} != {want.shape}", flush=True)
            ok = False
            continue
        for shard in result.addressable_shards:
            err = rel_error(np.asarray(shard.data, np.float32), want[shard.index])
            passed = err <= TOLERANCE[dtype_name]
            ok &= passed
            rows = shard.index[0]
            print(
                f"{'ok  ' if passed else 'FAIL'} process {jax.process_index()} {transport} {dtype_name} {routing} "
                f"{name} [{rows.start}:{rows.stop}]: rel err {err:.2e} (tol {TOLERANCE[dtype_name]:.0e})",
                flush=True,
            )
    return ok


def ragged_is_rejected(mesh: Mesh) -> bool:
    """XLA refuses ragged_all_to_all across processes; moe_ffn_ep must say so before anything runs."""
    try:
        check(mesh, "ragged", "float32", "uniform")
    except ValueError as err:
        rejected = "within one process" in str(err)
    else:
        rejected = False
    print(
        f"{'ok  ' if rejected else 'FAIL'} process {jax.process_index()} transport='ragged' rejected across processes",
        flush=True,
    )
    return rejected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of process 0's coordination service")
    parser.add_argument("--transports", default="xla")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--routings", default="uniform,zipf,all_to_one")
    opts = parser.parse_args()

    jax.distributed.initialize(
        coordinator_address=opts.coordinator, num_processes=opts.num_processes, process_id=opts.process_id
    )
    mesh = Mesh(np.array(jax.devices()), ("expert",))
    print(
        f"process {jax.process_index()}/{jax.process_count()}: local {jax.local_devices()}, "
        f"mesh over {mesh.size} devices",
        flush=True,
    )
    ok = True
    for transport in opts.transports.split(","):
        for dtype_name in opts.dtypes.split(","):
            for routing in opts.routings.split(","):
                ok &= check(mesh, transport, dtype_name, routing)
    ok &= ragged_is_rejected(mesh)
    jax.distributed.shutdown()
    print(f"process {opts.process_id}: {'all checks passed' if ok else 'SOME CHECKS FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
