"""The CUDA implementation of moe_ffn beyond parity (marker `gpu`; parity itself: tests/test_parity.py, whose
"cuda" parametrisation runs every case there): the kernels are built and chosen by "auto", their expert
layout is the CPU kernels', float16 is refused clearly, and XLA captures the calls into CUDA graphs (observed
from outside, in XLA's dump of the final thunk sequence) with outputs bit for bit those of the run without
command buffers. Run on an H200 by scripts/gpu_check.sh.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import Case, make_problem, seeded_rng, value_and_grads

import jax_megamoe as jmm
from jax_megamoe import _ffi
from jax_megamoe.ops import moe as moe_ops

pytestmark = pytest.mark.gpu

CUDA_TARGETS = ("jmm_cuda_moe_layout", "jmm_cuda_moe_gate_up", "jmm_cuda_moe_down", "jmm_cuda_moe_backward")


def test_cuda_kernels_are_built_and_auto_uses_them():
    assert _ffi.has_cuda_kernels(), "jax_megamoe was built without its CUDA kernels"
    args, dy = make_problem(Case(64, 64, 32, 4, 2), jnp.float32, seed="auto")
    auto = jax.jit(functools.partial(value_and_grads, jmm.moe_ffn))
    cuda = jax.jit(functools.partial(value_and_grads, functools.partial(jmm.moe_ffn, implementation="cuda")))
    text = auto.lower(args, dy).as_text()
    assert all(target in text for target in CUDA_TARGETS) and "jmm_cpu_" not in text
    for a, b in zip(auto(args, dy), cuda(args, dy), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layout_matches_cpu_kernels():
    experts = jnp.asarray(seeded_rng("layout").integers(-1, 17, (333, 4)), jnp.int32)
    gpu = jax.jit(lambda e: moe_ops.moe_layout(e, 16, "cuda"))(experts)
    on_cpu = jax.device_put(np.asarray(experts), jax.devices("cpu")[0])
    cpu = jax.jit(lambda e: moe_ops.moe_layout(e, 16, "cpu"))(on_cpu)
    for got, want in zip(gpu, cpu, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_float16_is_refused_naming_the_implementation():
    (x, weights, experts, w_gate_up, w_down), _ = make_problem(Case(8, 16, 8, 2, 1), jnp.float16, seed="f16")
    with pytest.raises(TypeError, match="cuda"):
        jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, implementation="cuda")


def test_cpu_kernels_on_gpu_arrays_fail_with_our_message():
    """implementation="cpu" while the default device is a GPU: jax_megamoe's error (trace or lowering time),
    not XLA's "No FFI handler registered for jmm_cpu_moe_layout on a platform CUDA"."""
    args, _ = make_problem(Case(8, 16, 8, 2, 1), jnp.float32, seed="cpu on gpu")
    with pytest.raises(ValueError, match="implementation='cpu'") as err:
        jax.jit(functools.partial(jmm.moe_ffn, implementation="cpu"))(*args)
    assert "No FFI handler" not in str(err.value)


# Runs forward+backward (bf16 tensor-core path and float32 SIMT path) on two inputs each, in a fresh process
# whose XLA_FLAGS are given (XLA reads them when its GPU client starts), and saves every output. It runs in tests/,
# where `python -c` finds the tests' helpers.
_GRAPH_SCRIPT = """
import sys
import numpy as np, jax, jax.numpy as jnp
import functools
import jax_megamoe as jmm
from moe_cases import Case, make_problem, value_and_grads
out = {}
for dtype, case in ((jnp.bfloat16, Case(512, 256, 128, 16, 4)), (jnp.float32, Case(96, 40, 24, 6, 2))):
    step = jax.jit(functools.partial(value_and_grads, functools.partial(jmm.moe_ffn, implementation="cuda")))
    for seed in (0, 1):
        args, dy = make_problem(case, dtype, seed=("graphs", seed))
        for j, value in enumerate(step(args, dy)):
            out[f"{jnp.dtype(dtype).name}_{seed}_{j}"] = np.asarray(value.astype(jnp.float32))
np.savez(sys.argv[1], **out)
"""
GRAPH_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def _run_graph_script(tmp_path, name, xla_flags):
    out, dump = tmp_path / f"{name}.npz", tmp_path / f"{name}_dump"
    env = dict(os.environ, XLA_FLAGS=f"{xla_flags} --xla_dump_to={dump} --xla_dump_hlo_as_text")
    proc = subprocess.run(
        [sys.executable, "-c", _GRAPH_SCRIPT, str(out)],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out), sorted(dump.glob("*gpu_after_optimizations.txt"))


def custom_call_targets(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> custom-call target, for our targets in an optimized module's text."""
    return dict(re.findall(r'%?([\w.\-]+) = [^\n]*custom_call_target="(jmm_[a-z_]+)"', hlo_text))


def thunk_annotations(metadata_text: str) -> dict[int, str]:
    """Thunk id -> its profile annotation (the HLO instruction it runs), from `*.thunk_metadata.txt`."""
    found = {}
    for block in metadata_text.split("thunk_metadata {")[1:]:
        annotation = re.search(r'profile_annotation: "([^"]+)"', block)
        thunk_id = re.search(r"thunk_id: (\d+)", block)
        if annotation and thunk_id:
            found[int(thunk_id.group(1))] = annotation.group(1)
    return found


def captured_targets(dumps) -> tuple[set[str], set[str]]:
    """`(targets inside a command buffer, targets outside one)`: our custom calls in XLA's final thunk sequence
    (`*.thunk_sequence_after_thunk_passes.txt`, one thunk per line as `ID: KIND`, the thunks a command buffer
    records indented under its `kCommandBuffer` line), named through the thunk metadata and the optimized HLO."""
    inside, outside = set(), set()
    for hlo_path in dumps:
        stem = hlo_path.name.split(".sm_")[0]
        targets = custom_call_targets(hlo_path.read_text())
        if not targets:
            continue
        annotations = thunk_annotations((hlo_path.parent / f"{stem}.thunk_metadata.txt").read_text())
        # XLA writes the sequence after its thunk passes (where command buffers are formed) only when they ran.
        final = hlo_path.parent / f"{stem}.thunk_sequence_after_thunk_passes.txt"
        sequence = (final if final.exists() else hlo_path.parent / f"{stem}.thunk_sequence.txt").read_text()
        for line in sequence.splitlines():
            entry = re.match(r"^(\s*)(\d+): (\w+)", line)
            if entry and entry.group(3) == "kCustomCall":
                target = targets.get(annotations.get(int(entry.group(2)), ""))
                assert target is not None, f"{stem}: custom-call thunk {line.strip()!r} not named by its metadata"
                (inside if entry.group(1) else outside).add(target)
    return inside, outside


def test_cuda_graph_capture_matches_uncaptured_run(tmp_path):
    """The handlers claim command-buffer compatibility (their temporaries are a workspace result): with custom
    calls allowed into command buffers, XLA's optimized program puts every jmm_cuda_moe_* call inside a command
    buffer (read from its thunk dumps), and every output, on two inputs per dtype (a recorded graph replayed with other
    buffers), equals the run without command buffers bit for bit."""
    captured, captured_dumps = _run_graph_script(tmp_path, "captured", GRAPH_FLAGS)
    plain, plain_dumps = _run_graph_script(tmp_path, "plain", "--xla_gpu_enable_command_buffer=")
    assert captured_dumps and plain_dumps
    inside, outside = captured_targets(captured_dumps)
    assert inside == set(CUDA_TARGETS) and not (outside & set(CUDA_TARGETS)), (inside, outside)
    inside, outside = captured_targets(plain_dumps)
    assert inside == set() and outside == set(CUDA_TARGETS), (inside, outside)
    assert sorted(captured.files) == sorted(plain.files) and len(plain.files) == 2 * 2 * 5
    for name in plain.files:
        np.testing.assert_array_equal(captured[name], plain[name], err_msg=name)
