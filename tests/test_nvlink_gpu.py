"""The nvlink transport on GPUs (marker `gpu`): emulated shards on one GPU, and two real GPUs where present.

Emulation (`NvlinkWorkspace.emulated(R)` under `jax.vmap(axis_name=...)`) runs the real kernels and the
real protocol (epochs, staging reuse, bounded waits) with R shards' memory on one GPU. Checks:
- the plain exchange against its definition, for every copy width (16-, 4- and 1-byte units) and
  `blocks_per_peer`, with the staging blocks poisoned by an earlier call so stale rows would show;
- `moe_ffn_ep(transport=NvlinkTransport(ws))`, bf16 at tensor-core shapes, through the checks every transport
  shares (tests/transport_cases.py): the program calls the three fused targets, and forward, all gradients and
  the stats are bit for bit the "xla" transport's, run to run, and close to the float32 reference on the problem
  without the dropped pairs, for R = 2, 4, 8, uniform, Zipf and all-to-one routing and both block layouts (x as
  every destination's block: dropless; compacted send blocks: a capacity below T rows); K = 1, empty experts,
  K > E_local; and successive different problems on one workspace;
- where the fused path cannot apply (float32, H not a multiple of 8) moe_ffn_ep runs "xla" and warns once why;
- with recipe="fp8_blockwise" (rows cross quantised by the plain exchange, no fused call): bit for bit the xla
  transport, run to run, and within the recipe's bound of moe_ffn with the recipe on the gathered problem;
- under jax.checkpoint with the named residuals saved, the compiled program runs each fused call once;
- on two GPUs: the same equalities across real NVLink, and that a shard whose peer never arrives fails with
  the bounded-wait message (timeout_ms) instead of hanging; making a workspace loads every kernel of the library.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from moe_cases import (
    OUTPUT_NAMES,
    Case,
    make_problem,
    merge_shards,
    rel_error,
    seeded_rng,
    split_shards,
    value_and_grads,
)
from transport_cases import EpCase, TransportBase, assert_bitwise_equal, parametrize_cases

import jax_megamoe as jmm
from jax_megamoe.parallel import ep as ep_module
from jax_megamoe.parallel.nvlink import exchange

pytestmark = pytest.mark.gpu
# The nvlink transport's fused FFI targets.
FUSED_CALLS = ("jmm_cuda_nvlink_moe_gate_up", "jmm_cuda_nvlink_moe_down", "jmm_cuda_nvlink_moe_backward")


def fused_calls(fn, *args) -> list[str]:
    """Which of the fused FFI targets the program of jitted `fn` on `args` calls."""
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
@pytest.mark.parametrize("blocks_per_peer", [1, 16, 64])
def test_emulated_exchange_matches_definition(ranks, dtype, width, blocks_per_peer):
    capacity = 37
    rng = seeded_rng("exchange", ranks, width)
    fill = -1 if dtype == jnp.int32 else 0
    with jmm.NvlinkWorkspace.emulated(
        ranks, max_tokens=capacity, hidden=width, top_k=1, dtype=dtype, blocks_per_peer=blocks_per_peer
    ) as ws:
        fn = jax.jit(jax.vmap(lambda b, s, r: exchange.exchange(b, s, r, ws, fill), axis_name="shards"))
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
    args, dy = make_problem(
        Case(ranks * tokens, hidden, inter, experts, top_k, routing), dtype, seed=("nvlink gpu", seed)
    )
    return tuple(split_shards(a, ranks) for a in args), split_shards(dy, ranks)


def emulated_ep(transport, **options):
    per_shard = functools.partial(jmm.moe_ffn_ep, axis_name="expert", transport=transport, **options)
    return jax.vmap(per_shard, axis_name="expert")


def emulated_nvlink(ranks, args, dy, runs=1, **options):
    """`(fused, results)` of emulated `moe_ffn_ep` on the nvlink transport: which fused calls the lowered
    program makes, and `runs` results of `value_and_grads`."""
    x, _, ids, _, _ = args
    with jmm.NvlinkWorkspace.emulated(
        ranks, max_tokens=x.shape[1], hidden=x.shape[2], top_k=ids.shape[2], dtype=x.dtype
    ) as ws:
        fn = jax.jit(functools.partial(value_and_grads, emulated_ep(jmm.NvlinkTransport(ws), **options)))
        return fused_calls(fn, args, dy), [jax.block_until_ready(fn(args, dy)) for _ in range(runs)]


def xla_results(args, dy, **options):
    return jax.jit(functools.partial(value_and_grads, emulated_ep("xla", **options)))(args, dy)


# The capacity factor of each block layout: dropless puts x itself in every destination's block; a factor
# whose pair capacity ceil(f * T * K / R) is 3/4 of T compacts the rows into send blocks.
LAYOUTS = {"x_as_blocks": lambda ranks, top_k: None, "send_blocks": lambda ranks, top_k: 0.75 * ranks / top_k}

pytest_generate_tests = parametrize_cases


class TestNvlinkEmulated(TransportBase):
    """R shards emulated on one GPU (`NvlinkWorkspace.emulated(R)` under `jax.vmap(axis_name="expert")`), bf16 at
    tensor-core shapes, so that the fused calls run."""

    size = Case(96, 128, 64, 32, 4)  # 96 tokens per shard
    dtype = jnp.bfloat16
    cases = (
        *(
            EpCase(ranks, routing, LAYOUTS[layout](ranks, 4))
            for layout in LAYOUTS
            for ranks in (2, 4, 8)
            for routing in ("uniform", "zipf", "all_to_one")
        ),
        EpCase(4, "uniform", top_k=1),  # one column per row
        EpCase(4, "empty_experts"),  # empty (expert, source) groups, empty experts and empty shards
        EpCase(8, "zipf", 1.0, experts=16),  # K > E_local (rows carry summed per-expert columns), pairs dropped
    )

    @contextlib.contextmanager
    def opened(self, case, problem):
        with jmm.NvlinkWorkspace.emulated(
            case.shards,
            max_tokens=problem.tokens // case.shards,
            hidden=problem.hidden,
            top_k=problem.top_k,
            dtype=self.dtype,
        ) as ws:
            yield jmm.NvlinkTransport(ws)

    def sharded(self, per_shard, case):
        emulated = jax.vmap(per_shard, axis_name="expert")

        def gathered(*args):
            return tuple(merge_shards(out) for out in emulated(*(split_shards(a, case.shards) for a in args)))

        return gathered

    def check_program(self, lowered, case):
        text = lowered.as_text()
        assert [target for target in FUSED_CALLS if target in text] == list(FUSED_CALLS)


def test_emulated_nvlink_sees_each_calls_own_rows():
    """One workspace, successive calls on different problems: a call that read a push slot or a group counter
    left by the call before would differ from xla (the calls above repeat one problem, which would hide it)."""
    ranks, tokens, hidden, inter, experts, top_k = 4, 96, 128, 64, 32, 4
    problems = [
        make_shards(seed, ranks, tokens, hidden, inter, experts, top_k, jnp.bfloat16, routing)
        for seed, routing in [(21, "uniform"), (22, "all_to_one"), (23, "zipf")]
    ]
    xla = jax.jit(functools.partial(value_and_grads, emulated_ep("xla")))
    with jmm.NvlinkWorkspace.emulated(ranks, max_tokens=tokens, hidden=hidden, top_k=top_k) as ws:
        ours = jax.jit(functools.partial(value_and_grads, emulated_ep(jmm.NvlinkTransport(ws))))
        assert fused_calls(ours, *problems[0]) == list(FUSED_CALLS)
        for args, dy in problems + problems[:1]:
            assert_bitwise_equal(jax.block_until_ready(ours(args, dy)), xla(args, dy))


@pytest.mark.parametrize(
    "dtype, hidden, reason", [(jnp.float32, 128, "bfloat16"), (jnp.bfloat16, 132, "multiples of 8")]
)
def test_where_the_fused_path_cannot_apply_xla_runs_with_one_warning(monkeypatch, dtype, hidden, reason):
    """float32 (no tensor cores) or H not a multiple of 8: moe_ffn_ep warns once naming why and runs the xla
    transport, bit for bit, with no fused call in the program."""
    monkeypatch.setattr(ep_module, "_warned", set())
    ranks, tokens, inter, experts, top_k = 2, 96, 64, 32, 4
    args, dy = make_shards(11, ranks, tokens, hidden, inter, experts, top_k, dtype, "zipf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused, (first, second) = emulated_nvlink(ranks, args, dy, runs=2)
    fell_back = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(fell_back) == 1 and reason in fell_back[0] and "'xla'" in fell_back[0], fell_back
    assert fused == []
    assert_bitwise_equal(first, xla_results(args, dy))
    assert_bitwise_equal(second, first)


def check_fp8_nvlink(seed, ranks, routing, tokens, hidden, inter, experts, top_k, capacity_factor=None):
    """With the recipe: no fused call, the rows as e4m3 bytes through the plain exchange; twice bit for bit alike,
    bit for bit the xla transport (the same quantised rows arrive, whichever rows each transport moves), and the
    gathered problem's moe_ffn with the recipe within its bound when nothing is dropped."""
    args, dy = make_shards(seed, ranks, tokens, hidden, inter, experts, top_k, jnp.bfloat16, routing)
    options = dict(capacity_factor=capacity_factor, recipe="fp8_blockwise")
    with jmm.NvlinkWorkspace.emulated(ranks, max_tokens=tokens, hidden=hidden, top_k=top_k) as ws:
        fn = jax.jit(functools.partial(value_and_grads, emulated_ep(jmm.NvlinkTransport(ws), **options)))
        text = fn.lower(args, dy).as_text()
        first, second = (jax.block_until_ready(fn(args, dy)) for _ in range(2))
        layer = emulated_ep(jmm.NvlinkTransport(ws), **options)
        forward = jax.jit(lambda a: layer(*a)).lower(args).compile().as_text()
    assert [t for t in FUSED_CALLS if t in text] == []
    # A forward alone: ids, weights, q(x)'s values and scales out, the results back (the zeros that carry the rows'
    # gradient in a backward are dead code here, and XLA drops their exchange).
    assert forward.count('custom_call_target="jmm_cuda_nvlink_exchange"') == 5, forward
    assert "jmm_cuda_nvlink_exchange" in text and "jmm_cuda_fp8_rows_gemm" in text
    assert_bitwise_equal(first, second)
    assert_bitwise_equal(first, xla_results(args, dy, **options))
    if capacity_factor is None:  # the gathered problem; shards' weights merge along the experts as tokens do
        single = functools.partial(value_and_grads, functools.partial(jmm.moe_ffn, recipe="fp8_blockwise"))
        want = jax.jit(single)(tuple(merge_shards(a) for a in args), merge_shards(dy))
        for name, got, expected in zip(OUTPUT_NAMES, first, want, strict=True):
            err = rel_error(merge_shards(got), expected)
            assert err <= 1e-2, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "ranks, routing, hidden, inter, experts, top_k, capacity_factor",
    [
        (2, "uniform", 256, 128, 16, 4, None),
        (4, "zipf", 256, 128, 16, 2, None),  # experts past 128 rows: token tiles across sources
        (4, "all_to_one", 128, 128, 8, 2, None),
        (8, "empty_experts", 136, 72, 32, 4, None),  # H, I not multiples of 128
        (4, "uniform", 128, 128, 16, 4, 0.75),  # pairs dropped
        (8, "zipf", 128, 128, 16, 4, None),  # K > E_local
    ],
)
def test_emulated_nvlink_fp8_equals_xla(ranks, routing, hidden, inter, experts, top_k, capacity_factor):
    check_fp8_nvlink(
        3 * ranks + top_k, ranks, routing, 96, hidden, inter, experts, top_k, capacity_factor=capacity_factor
    )


def fused_counts(fn, *args) -> tuple[dict[str, int], dict[str, int]]:
    """How many calls of each fused target the lowered and the compiled program of jitted `fn` make."""
    lowered = fn.lower(*args)
    text, compiled = lowered.as_text(), lowered.compile().as_text()
    return (
        {target: text.count(f"@{target}(") for target in FUSED_CALLS},
        {target: compiled.count(f'custom_call_target="{target}"') for target in FUSED_CALLS},
    )


def test_checkpoint_saving_the_named_residuals_recomputes_no_fused_call():
    """Under jax.checkpoint with save_only_these_names("moe_layout", "moe_gate_up", "moe_rows") the program,
    lowered and compiled on the GPU, runs each fused call once, as without jax.checkpoint; with no policy the
    lowered program runs the gate_up call twice (the recomputation) and the others once, and the compiled one
    keeps one down and one backward call; all three give the plain gradients bit for bit."""
    ranks, tokens, hidden, inter, experts, top_k = 2, 96, 128, 64, 32, 4
    args, dy = make_shards(31, ranks, tokens, hidden, inter, experts, top_k, jnp.bfloat16, "zipf")
    policy = jax.checkpoint_policies.save_only_these_names("moe_layout", "moe_gate_up", "moe_rows")
    with jmm.NvlinkWorkspace.emulated(ranks, max_tokens=tokens, hidden=hidden, top_k=top_k) as ws:
        layer = emulated_ep(jmm.NvlinkTransport(ws))
        steps = {
            name: jax.jit(functools.partial(value_and_grads, fn))
            for name, fn in (
                ("plain", layer),
                ("saved", jax.checkpoint(layer, policy=policy)),
                ("recomputed", jax.checkpoint(layer)),
            )
        }
        counts = {name: fused_counts(step, args, dy) for name, step in steps.items()}
        results = {name: jax.block_until_ready(step(args, dy)) for name, step in steps.items()}
    once = dict.fromkeys(FUSED_CALLS, 1)
    for name in ("plain", "saved"):
        assert counts[name] == (once, once), (name, counts[name])
    lowered, compiled = counts["recomputed"]
    assert lowered == once | {"jmm_cuda_nvlink_moe_gate_up": 2}, lowered
    assert compiled["jmm_cuda_nvlink_moe_down"] == compiled["jmm_cuda_nvlink_moe_backward"] == 1, compiled
    assert_bitwise_equal(results["saved"], results["plain"])
    assert_bitwise_equal(results["recomputed"], results["plain"])


def test_workspace_too_small_is_reported():
    with jmm.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=128, top_k=2) as ws:
        args, _ = make_shards(1, 2, 32, 128, 64, 4, 2, jnp.bfloat16, "uniform")
        with pytest.raises(ValueError, match="workspace too small"):
            emulated_ep(jmm.NvlinkTransport(ws))(*args)


def two_gpu_ep(gpus, **options):
    mesh = Mesh(np.array(gpus[:2]), ("expert",))
    spec = P("expert")
    fn = jax.shard_map(functools.partial(jmm.moe_ffn_ep, **options), mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    return mesh, fn


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("routing", ["uniform", "zipf", "all_to_one"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_two_gpus_nvlink_equals_xla_transport(gpus, routing, dtype, layout):
    """Three calls in a row across real NVLink, each bit for bit the xla transport (whose accuracy against the
    reference on two GPUs is tests/test_ep_gpu.py::test_two_gpus_match_reference): the fused calls for bf16,
    the fallback to xla for float32."""
    tokens, hidden, inter, experts, top_k = 1024, 512, 256, 32, 4
    capacity_factor = LAYOUTS[layout](2, top_k)
    args, dy = make_shards(5, 2, tokens, hidden, inter, experts, top_k, dtype, routing)
    args, dy = tuple(merge_shards(a) for a in args), merge_shards(dy)
    mesh, xla_fn = two_gpu_ep(gpus, transport="xla", capacity_factor=capacity_factor)
    xla = jax.block_until_ready(jax.jit(functools.partial(value_and_grads, xla_fn))(args, dy))
    with jmm.NvlinkWorkspace(mesh, "expert", max_tokens=tokens, hidden=hidden, top_k=top_k, dtype=dtype) as ws:
        ours = jax.jit(
            functools.partial(
                value_and_grads,
                two_gpu_ep(gpus, transport=jmm.NvlinkTransport(ws), capacity_factor=capacity_factor)[1],
            )
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # float32's fallback (its warning: the test above)
            fused = fused_calls(ours, args, dy)
            runs = [jax.block_until_ready(ours(args, dy)) for _ in range(3)]
    assert fused == (list(FUSED_CALLS) if dtype == jnp.bfloat16 else [])
    for run in runs:
        assert_bitwise_equal(run, xla)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("routing", ["uniform", "zipf"])
def test_two_gpus_nvlink_fp8_equals_xla_transport(gpus, routing):
    """recipe="fp8_blockwise" across real NVLink: the rows cross as e4m3 bytes by the plain exchange, twice bit for
    bit the xla transport."""
    tokens, hidden, inter, experts, top_k = 1024, 512, 256, 32, 4
    args, dy = make_shards(6, 2, tokens, hidden, inter, experts, top_k, jnp.bfloat16, routing)
    args, dy = tuple(merge_shards(a) for a in args), merge_shards(dy)
    mesh, xla_fn = two_gpu_ep(gpus, transport="xla", recipe="fp8_blockwise")
    xla = jax.block_until_ready(jax.jit(functools.partial(value_and_grads, xla_fn))(args, dy))
    with jmm.NvlinkWorkspace(mesh, "expert", max_tokens=tokens, hidden=hidden, top_k=top_k) as ws:
        _, fn = two_gpu_ep(gpus, transport=jmm.NvlinkTransport(ws), recipe="fp8_blockwise")
        ours = jax.jit(functools.partial(value_and_grads, fn))
        assert fused_calls(ours, args, dy) == []
        runs = [jax.block_until_ready(ours(args, dy)) for _ in range(2)]
    for run in runs:
        assert_bitwise_equal(run, xla)


MISSING_PEER = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    import jax_megamoe as jmm
    from jax_megamoe.parallel.nvlink import exchange
    gpus = jax.devices()[:2]
    ws = jmm.NvlinkWorkspace(Mesh(np.array(gpus), ("expert",)), "expert", max_tokens=4, hidden=8, top_k=1,
                             dtype=jnp.float32, timeout_ms=500)
    counts = jnp.array([4, 4], jnp.int32)
    # Only GPU 0 runs the exchange: its receive waits for GPU 1, which never sends.
    out = jax.jit(lambda b, c: exchange.exchange(b, c, c, ws))(jax.device_put(jnp.ones((2, 4, 8)), gpus[0]), counts)
    print("finished", float(out.sum()))
""")


@pytest.mark.gpu(count=2)
def test_missing_peer_fails_with_bounded_wait_message():
    proc = subprocess.run([sys.executable, "-c", MISSING_PEER], capture_output=True, text=True, timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "finished" not in output
    assert "shard 0 timed out after 500 ms in phase 'receive (rows arrive)' waiting for shard 1" in output, output


LOAD_COUNTS = textwrap.dedent("""
    import json, jax
    import jax_megamoe as jmm
    from jax_megamoe import _ffi
    ext = _ffi.extension()
    device = jax.devices()[0].local_hardware_id
    before = ext.loaded_kernel_counts(device)
    ws = jmm.NvlinkWorkspace.emulated(2, max_tokens=8, hidden=64, top_k=1)
    print(json.dumps({"before": before, "after": ext.loaded_kernel_counts(device)}))
""")


def test_workspace_loads_every_kernel_of_the_library():
    """Under CUDA's lazy loading a kernel's first launch loads it, and a load may wait for the kernels running in the
    process, which deadlocks with a peer spinning on this GPU's push (cuda/kernels/kernel_modules.h): the workspace
    loads every kernel of the library, on each of its devices, when it is made; observed through the documented
    query `_ext.loaded_kernel_counts(device)` -> (total, not loaded). A fresh process, so that nothing of ours has
    been loaded before."""
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY")
    proc = subprocess.run([sys.executable, "-c", LOAD_COUNTS], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    total, not_loaded = counts["before"]
    root = Path(__file__).parents[1] / "cuda"
    kernel_files = len([*(root / "kernels").glob("*.cu"), *(root / "nvlink").glob("*.cu")])
    assert total > kernel_files  # every file's anchor kernel, and the kernels beside it
    assert not_loaded > 0, counts  # lazy loading is in effect, so the check below means something
    assert counts["after"] == [total, 0], counts
