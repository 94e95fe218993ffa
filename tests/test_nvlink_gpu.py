"""The NVLink transport on GPUs (marker `gpu`): emulated shards on one GPU, and two real GPUs where present.

Emulation (`NvlinkWorkspace.emulated(R)` under `jax.vmap(axis_name=...)`) runs the real kernels and the
real protocol (epochs, staging reuse, bounded waits) with R shards' memory on one GPU. Checks:
- the raw exchange against its definition, for every copy width (16-, 4- and 1-byte units), with the
  staging blocks poisoned by an earlier call so stale rows would show;
- `moe_ffn_ep(backend="nvlink")` with stage 1 (`overlap=False`) bit for bit equal to `backend="xla"` (same
  plan, same local kernels, same combine order), forward and all gradients, and close to the float32
  reference, for R = 2, 4, 8 and uniform, Zipf and all-to-one routing;
- stage 2's overlapped forward and backward (`overlap=True`, bf16 at tensor-core shapes): the program calls both
  fused handlers, and forward and gradients are bit for bit stage 1's and xla's, run to run, for the same R and
  routings and for K = 1, empty experts, and K > E_local with a capacity, and for successive different
  problems on one workspace; float32 falls back to stage 1;
- on two GPUs: the same equalities across real NVLink (both stages), and that a shard whose peer never
  arrives fails with the bounded-wait message instead of hanging.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_megamoe as jmm
from jax_megamoe.parallel import nvlink
from moe_cases import random_problem, reference_value_and_grads, rel_error, value_and_grads

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPUS, reason="needs an NVIDIA GPU")]
GRAD_NAMES = ("y", "dx", "d_weights", "d_w_gate_up", "d_w_down")
# Stage 2's FFI targets, the overlapped forward and backward (nvlink_experts.py).
FUSED_CALLS = ("jmm_cuda_nvlink_moe_forward", "jmm_cuda_nvlink_moe_backward")


def fused_calls(fn, *args) -> list[str]:
    """Which of stage 2's FFI targets the program of jitted `fn` on `args` calls."""
    text = fn.lower(*args).as_text()
    return [target for target in FUSED_CALLS if target in text]


def exchange_reference(buffer, send_counts, fill):
    """out[r, s, c] = buffer[s, r, c] for c < send_counts[s, r], else fill (buffer [R, R, C, ...])."""
    buffer = np.asarray(buffer)
    out = np.full_like(buffer, fill)
    for r in range(buffer.shape[0]):
        for s in range(buffer.shape[0]):
            n = send_counts[s, r]
            out[r, s, :n] = buffer[s, r, :n]
    return out


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("dtype, width", [(jnp.float32, 8), (jnp.int32, 3), (jnp.bfloat16, 5)])
@pytest.mark.parametrize("blocks_per_peer", ["1", "16", "64"])
def test_emulated_exchange_matches_definition(ranks, dtype, width, blocks_per_peer, monkeypatch):
    monkeypatch.setenv("JMM_NVLINK_BLOCKS_PER_PEER", blocks_per_peer)
    capacity = 37
    rng = np.random.default_rng(ranks * 100 + width)
    fill = -1 if dtype == jnp.int32 else 0
    with nvlink.NvlinkWorkspace.emulated(ranks, max_tokens=capacity, hidden=width, top_k=1, dtype=dtype) as ws:
        fn = jax.jit(jax.vmap(lambda b, s, r: nvlink.exchange(b, s, r, ws, fill), axis_name="shards"))
        full = np.full((ranks, ranks), capacity, np.int32)
        poison = jnp.full((ranks, ranks, capacity, width), 7, dtype)  # every staging row written once
        np.testing.assert_array_equal(np.asarray(fn(poison, full, full)), np.asarray(poison))
        for _ in range(5):  # epochs advance; each call must see only its own rows
            send_counts = rng.integers(0, capacity + 1, (ranks, ranks)).astype(np.int32)
            send_counts[0, -1] = 0  # an empty block
            buffer = jnp.asarray(rng.integers(-1000, 1000, (ranks, ranks, capacity, width)), dtype)
            out = fn(buffer, send_counts, send_counts.T.copy())
            np.testing.assert_array_equal(np.asarray(out), exchange_reference(buffer, send_counts, fill))


def make_shards(seed, ranks, tokens, hidden, inter, experts, top_k, dtype, routing):
    """A global problem split into `ranks` shards: tokens [R, T, ...], experts [R, E/R, ...]."""
    if routing == "all_to_one":  # every pair goes to shard 0's experts
        log_p = jnp.where(jnp.arange(experts) < experts // ranks, 0.0, -jnp.inf)
    elif routing == "zipf":
        log_p = -1.2 * jnp.log1p(jnp.arange(experts))
    elif routing == "empty_experts":  # every fourth expert gets no token: empty groups on every shard
        log_p = jnp.where(jnp.arange(experts) % 4 == 3, -jnp.inf, 0.0)
    else:
        log_p = jnp.zeros(experts)
    args, dy = random_problem(seed, ranks * tokens, hidden, inter, experts, top_k, dtype, log_p)
    split = lambda a: a.reshape((ranks, -1) + a.shape[1:])
    return tuple(split(a) for a in args), split(dy)


def assert_close_to_reference(results, args, dy):
    """Compares sharded results with the float32 reference on the gathered problem."""
    merge = lambda a: jnp.asarray(a).reshape((-1,) + a.shape[2:])
    expected = reference_value_and_grads(tuple(merge(a) for a in args), merge(dy))
    tolerance = 1e-2 if args[0].dtype == jnp.bfloat16 else 3e-4
    for name, got, want in zip(GRAD_NAMES, results, expected):
        err = rel_error(merge(got), want)
        assert err <= tolerance, f"{name}: relative error {err:.2e} > {tolerance}"


def assert_bitwise_equal(first, second):
    for name, a, b in zip(GRAD_NAMES, first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def emulated_ep(ranks, backend, workspace=None, **options):
    per_shard = functools.partial(jmm.moe_ffn_ep, axis_name="expert", backend=backend, workspace=workspace,
                                  **options)
    return jax.vmap(per_shard, axis_name="expert")


def emulated_nvlink(ranks, args, dy, overlap, runs=1, **options):
    """`(fused, results)` of emulated `moe_ffn_ep(backend="nvlink")` on a workspace made with `overlap`:
    which of stage 2's calls the lowered program makes, and `runs` results of `value_and_grads`."""
    x, _, ids, _, _ = args
    with jmm.NvlinkWorkspace.emulated(ranks, max_tokens=x.shape[1], hidden=x.shape[2], top_k=ids.shape[2],
                                      dtype=x.dtype, overlap=overlap) as ws:
        fn = jax.jit(functools.partial(value_and_grads, emulated_ep(ranks, "nvlink", ws, **options)))
        return fused_calls(fn, args, dy), [jax.block_until_ready(fn(args, dy)) for _ in range(runs)]


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("routing", ["uniform", "zipf", "all_to_one"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_emulated_moe_ffn_ep_equals_xla_transport(ranks, routing, dtype):
    """Stage 1 (overlap=False), run twice."""
    tokens, hidden, inter, experts, top_k = 96, 128, 64, 32, 4
    args, dy = make_shards(ranks + len(routing), ranks, tokens, hidden, inter, experts, top_k, dtype, routing)
    fused, (first, second) = emulated_nvlink(ranks, args, dy, overlap=False, runs=2)
    xla = jax.jit(functools.partial(value_and_grads, emulated_ep(ranks, "xla")))(args, dy)
    assert fused == []
    assert_bitwise_equal(first, second)
    assert_bitwise_equal(first, xla)
    assert_close_to_reference(first, args, dy)


def check_overlap_equals_stage1_and_xla(seed, ranks, routing, tokens, hidden, inter, experts, top_k, **options):
    """The overlapped forward and backward (bf16, tensor-core shapes) run, twice bit for bit alike and equal to
    stage 1 and to xla (forward and all gradients), and close to the reference when nothing is dropped."""
    assert hidden % 8 == 0 and inter % 8 == 0, "tensor-core shapes: the overlapped forward applies only to these"
    args, dy = make_shards(seed, ranks, tokens, hidden, inter, experts, top_k, jnp.bfloat16, routing)
    fused, (first, second) = emulated_nvlink(ranks, args, dy, overlap=True, runs=2, **options)
    assert fused == list(FUSED_CALLS), f"overlap=True called only {fused}"
    stage1_fused, (stage1,) = emulated_nvlink(ranks, args, dy, overlap=False, **options)
    assert stage1_fused == []
    xla = jax.jit(functools.partial(value_and_grads, emulated_ep(ranks, "xla", **options)))(args, dy)
    assert_bitwise_equal(first, second)
    assert_bitwise_equal(first, stage1)
    assert_bitwise_equal(first, xla)
    if options.get("capacity_factor") is None:  # with drops the reference is another problem (test_ep.py)
        assert_close_to_reference(first, args, dy)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("routing", ["uniform", "zipf", "all_to_one"])
def test_emulated_overlap_equals_stage1_and_xla(ranks, routing):
    check_overlap_equals_stage1_and_xla(ranks + len(routing), ranks, routing, tokens=96, hidden=128, inter=64,
                                        experts=32, top_k=4)


@pytest.mark.parametrize("ranks, routing, experts, top_k, capacity_factor", [
    (4, "uniform", 32, 1, None),           # K = 1: one column per row
    (4, "empty_experts", 32, 4, None),     # empty (expert, source) groups and empty experts on every shard
    (8, "zipf", 16, 4, 1.0),               # K > E_local (rows carry summed per-expert columns), pairs dropped
])
def test_emulated_overlap_edge_cases(ranks, routing, experts, top_k, capacity_factor):
    check_overlap_equals_stage1_and_xla(7 * ranks + top_k, ranks, routing, tokens=96, hidden=128, inter=64,
                                        experts=experts, top_k=top_k, capacity_factor=capacity_factor)


def test_emulated_overlap_sees_each_calls_own_rows():
    """One workspace, successive calls on different problems: a call that read a push slot or a group counter
    left by the call before would differ from xla (the calls above repeat one problem, which would hide it)."""
    ranks, tokens, hidden, inter, experts, top_k = 4, 96, 128, 64, 32, 4
    problems = [make_shards(seed, ranks, tokens, hidden, inter, experts, top_k, jnp.bfloat16, routing)
                for seed, routing in [(21, "uniform"), (22, "all_to_one"), (23, "zipf")]]
    xla = jax.jit(functools.partial(value_and_grads, emulated_ep(ranks, "xla")))
    with jmm.NvlinkWorkspace.emulated(ranks, max_tokens=tokens, hidden=hidden, top_k=top_k, overlap=True) as ws:
        ours = jax.jit(functools.partial(value_and_grads, emulated_ep(ranks, "nvlink", ws)))
        assert fused_calls(ours, *problems[0]) == list(FUSED_CALLS)
        for args, dy in problems + problems[:1]:
            assert_bitwise_equal(jax.block_until_ready(ours(args, dy)), xla(args, dy))


def test_emulated_float32_with_overlap_runs_stage1():
    """overlap=True does not apply to float32 (no tensor cores): stage 1 runs, bit for bit xla."""
    ranks, tokens, hidden, inter, experts, top_k = 2, 96, 128, 64, 32, 4
    args, dy = make_shards(11, ranks, tokens, hidden, inter, experts, top_k, jnp.float32, "zipf")
    fused, (ours,) = emulated_nvlink(ranks, args, dy, overlap=True)
    xla = jax.jit(functools.partial(value_and_grads, emulated_ep(ranks, "xla")))(args, dy)
    assert fused == []
    assert_bitwise_equal(ours, xla)


def test_workspace_too_small_is_reported():
    with jmm.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=16, top_k=2, dtype=jnp.float32) as ws:
        args, _ = make_shards(1, 2, 32, 16, 8, 4, 2, jnp.float32, "uniform")
        with pytest.raises(ValueError, match="workspace too small"):
            emulated_ep(2, "nvlink", ws)(*args)


def two_gpu_ep(**options):
    mesh = Mesh(np.array(GPUS[:2]), ("expert",))
    spec = P("expert")
    fn = jax.shard_map(functools.partial(jmm.moe_ffn_ep, **options), mesh=mesh, in_specs=(spec,) * 5,
                       out_specs=spec)
    return mesh, fn


def check_two_gpus_nvlink_equals_xla(routing, dtype, overlap):
    """Three calls in a row of `backend="nvlink"` on a workspace made with `overlap`, each bit for bit the xla
    transport; returns which of stage 2's calls the program made."""
    tokens, hidden, inter, experts, top_k = 1024, 512, 256, 32, 4
    args, dy = make_shards(5, 2, tokens, hidden, inter, experts, top_k, dtype, routing)
    flat = lambda a: a.reshape((-1,) + a.shape[2:])
    args, dy = tuple(flat(a) for a in args), flat(dy)
    mesh, xla_fn = two_gpu_ep(backend="xla")
    xla = jax.block_until_ready(jax.jit(functools.partial(value_and_grads, xla_fn))(args, dy))
    with jmm.NvlinkWorkspace(mesh, "expert", max_tokens=tokens, hidden=hidden, top_k=top_k, dtype=dtype,
                             overlap=overlap) as ws:
        ours = jax.jit(functools.partial(value_and_grads, two_gpu_ep(backend="nvlink", workspace=ws)[1]))
        fused = fused_calls(ours, args, dy)
        runs = [jax.block_until_ready(ours(args, dy)) for _ in range(3)]
    for run in runs:
        assert_bitwise_equal(run, xla)
    return fused


@pytest.mark.skipif(len(GPUS) < 2, reason="needs two GPUs")
@pytest.mark.parametrize("routing", ["uniform", "zipf", "all_to_one"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_two_gpus_nvlink_equals_xla_transport(routing, dtype):
    """Stage 1 across real NVLink, bit for bit the xla transport (whose accuracy against the reference on two
    GPUs is tests/test_ep_gpu.py::test_two_gpus_match_reference)."""
    assert check_two_gpus_nvlink_equals_xla(routing, dtype, overlap=False) == []


@pytest.mark.skipif(len(GPUS) < 2, reason="needs two GPUs")
@pytest.mark.parametrize("routing", ["uniform", "zipf", "all_to_one"])
def test_two_gpus_overlap_equals_xla_transport(routing):
    """Stage 2's overlapped forward and backward across real NVLink (bf16, tensor-core shapes), bit for bit xla."""
    assert check_two_gpus_nvlink_equals_xla(routing, jnp.bfloat16, overlap=True) == list(FUSED_CALLS)


MISSING_PEER = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from jax_megamoe.parallel import nvlink
    gpus = jax.devices()[:2]
    ws = nvlink.NvlinkWorkspace(Mesh(np.array(gpus), ("expert",)), "expert", max_tokens=4, hidden=8, top_k=1,
                                dtype=jnp.float32)
    counts = jnp.array([4, 4], jnp.int32)
    # Only GPU 0 runs the exchange: its receive waits for GPU 1, which never sends.
    out = jax.jit(lambda b, c: nvlink.exchange(b, c, c, ws))(jax.device_put(jnp.ones((2, 4, 8)), gpus[0]), counts)
    print("finished", float(out.sum()))
""")


@pytest.mark.skipif(len(GPUS) < 2, reason="needs two GPUs")
def test_missing_peer_fails_with_bounded_wait_message():
    env = dict(os.environ, JMM_NVLINK_TIMEOUT_MS="500")
    proc = subprocess.run([sys.executable, "-c", MISSING_PEER], capture_output=True, text=True, timeout=240,
                          env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "finished" not in output
    assert "shard 0 timed out after 500 ms in phase 'receive (rows arrive)' waiting for shard 1" in output, output


LOAD_COUNTS = textwrap.dedent("""
    import json, jax
    from jax_megamoe import _ffi
    from jax_megamoe.parallel import nvlink
    ext = _ffi.extension()
    device = jax.devices()[0].local_hardware_id
    before = ext.kernel_load_counts(device)
    ws = nvlink.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=64, top_k=1)
    print(json.dumps({"before": before, "after": ext.kernel_load_counts(device)}))
""")


def test_workspace_loads_every_kernel_of_the_library():
    """Under CUDA's lazy loading a kernel's first launch loads it, and a load may wait for the kernels running in the
    process, which deadlocks with a peer spinning on this GPU's push (jmm/kernel_modules.h): the workspace loads
    every kernel of the library, on each of its devices, when it is made. A fresh process, so that nothing of ours
    has been loaded before."""
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")
    proc = subprocess.run([sys.executable, "-c", LOAD_COUNTS], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    total, not_loaded = counts["before"]
    kernel_files = len(list((Path(__file__).parents[1] / "cuda" / "kernels").glob("*.cu")))
    assert total > kernel_files  # every file's anchor kernel, and the kernels beside it
    assert not_loaded > 0, counts  # lazy loading is in effect, so the check below means something
    assert counts["after"] == [total, 0], counts
