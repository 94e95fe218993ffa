"""GPU parity of the CUDA MoE kernels (`backend="cuda"`) with the pure-JAX reference (marker `gpu`).

Every check draws fresh random inputs, compares forward and all four gradients against the float32
reference (float32: normwise relative error <= 1e-5; bf16: <= 1e-2) and rejects any non-finite value,
which is how unwritten (poisoned) output memory would show. Run on an H200 by scripts/gpu_check.sh.
"""

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_megamoe as jmm
from jax_megamoe import _ffi
from jax_megamoe.ops import moe as moe_ops
from moe_cases import reference_value_and_grads, rel_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs an NVIDIA GPU"),
]

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
_seed = itertools.count(1000)


def _key():
    return jax.random.PRNGKey(next(_seed))


def make_routing(key, tokens, num_experts, top_k, skew):
    """Distinct experts per token: uniform, or Zipf-skewed (p_e ~ 1/(e+1)^1.2) via Gumbel top-k."""
    k1, k2 = jax.random.split(key)
    log_p = jnp.zeros(num_experts) if skew == "uniform" else -1.2 * jnp.log1p(jnp.arange(num_experts))
    scores = log_p + jax.random.gumbel(k1, (tokens, num_experts))
    experts = jax.lax.top_k(scores, top_k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(k2, (tokens, top_k)), axis=-1)
    return weights, experts


def make_problem(tokens, hidden, inter, num_experts, top_k, dtype, skew="uniform", experts=None):
    keys = jax.random.split(_key(), 5)
    weights, routed = make_routing(keys[0], tokens, num_experts, top_k, skew)
    experts = routed if experts is None else jnp.asarray(experts, jnp.int32)
    x = jax.random.normal(keys[1], (tokens, hidden), jnp.float32).astype(dtype)
    w_gate_up = (jax.random.normal(keys[2], (num_experts, hidden, 2 * inter)) / np.sqrt(hidden)).astype(dtype)
    w_down = (jax.random.normal(keys[3], (num_experts, inter, hidden)) / np.sqrt(inter)).astype(dtype)
    dy = jax.random.normal(keys[4], (tokens, hidden), jnp.float32).astype(dtype)
    return x, weights, experts, w_gate_up, w_down, dy


def cuda_fn(x, weights, experts, w_gate_up, w_down):
    return jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, backend="cuda")


def run_with_grads(fn, x, weights, experts, w_gate_up, w_down, dy):
    """y and (dx, d_weights, d_w_gate_up, d_w_down) for cotangent dy."""
    y, vjp = jax.vjp(lambda a, w, g, d: fn(a, w, experts, g, d), x, weights, w_gate_up, w_down)
    return y, vjp(dy.astype(y.dtype))


def assert_close(name, got, want, dtype):
    got = np.asarray(jnp.asarray(got, jnp.float32))
    assert np.all(np.isfinite(got)), f"{name}: non-finite values (unwritten or NaN output)"
    err = rel_error(got, want)
    assert err <= TOLERANCE[dtype], f"{name}: normwise relative error {err:.3g} > {TOLERANCE[dtype]}"


def check_parity(tokens, hidden, inter, num_experts, top_k, dtype, skew="uniform", experts=None):
    problem = make_problem(tokens, hidden, inter, num_experts, top_k, dtype, skew, experts)
    y, grads = jax.jit(lambda *a: run_with_grads(cuda_fn, *a))(*problem)
    y_ref, *grads_ref = reference_value_and_grads(problem[:5], problem[5])
    assert y.dtype == dtype and y.shape == (tokens, hidden)
    assert_close("y", y, y_ref, dtype)
    for name, g, g_ref in zip(("dx", "d_weights", "d_w_gate_up", "d_w_down"), grads, grads_ref):
        assert_close(name, g, g_ref, dtype)


def test_cuda_kernels_are_built():
    assert _ffi.has_cuda_kernels(), "jax_megamoe was built without its CUDA kernels"
    assert moe_ops.resolve_backend("auto") == "cuda"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("skew", ["uniform", "zipf"])
def test_parity_moderate(dtype, skew):
    check_parity(tokens=256, hidden=128, inter=64, num_experts=16, top_k=4, dtype=dtype, skew=skew)


@pytest.mark.parametrize("skew", ["uniform", "zipf"])
def test_parity_bf16_multi_tile(skew):
    # Several 128 x 256 tensor-core tiles per expert along rows and columns, ragged expert sizes.
    check_parity(tokens=2048, hidden=512, inter=384, num_experts=32, top_k=4, dtype=jnp.bfloat16, skew=skew)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [
    dict(tokens=1, hidden=64, inter=32, num_experts=8, top_k=2),     # T = 1
    dict(tokens=64, hidden=64, inter=32, num_experts=8, top_k=1),    # K = 1
    dict(tokens=32, hidden=64, inter=32, num_experts=4, top_k=4),    # K = E
    dict(tokens=32, hidden=64, inter=32, num_experts=1, top_k=1),    # E = 1
    dict(tokens=37, hidden=20, inter=12, num_experts=5, top_k=2),    # H, I not multiples of 8
    dict(tokens=19, hidden=33, inter=7, num_experts=3, top_k=3),     # odd everything, K = E
])
def test_edge_shapes(dtype, shape):
    check_parity(dtype=dtype, **shape)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("inter", [13, 24, 2056])
def test_swiglu_backward_widths(dtype, inter):
    # Every path of the SwiGLU backward kernel (one warp per row): I = 13 is the scalar path for both dtypes,
    # I = 24 is 16-byte vectors (3 per bf16 row, 6 per float32 row), I = 2056 has more than 256 vectors per row
    # (several rounds of d_weights' summation threads). 6000 rows exceed the warps resident on an H200 at once,
    # so warps stride over several rows.
    check_parity(tokens=3000, hidden=32, inter=inter, num_experts=4, top_k=2, dtype=dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_empty_experts(dtype):
    experts = np.stack([np.arange(64) % 2, 2 + np.arange(64) % 3], axis=1)  # experts 5..15 get no rows
    check_parity(tokens=64, hidden=128, inter=64, num_experts=16, top_k=2, dtype=dtype, experts=experts)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_tokens_to_one_expert(dtype):
    experts = np.full((300, 1), 3)
    check_parity(tokens=300, hidden=128, inter=64, num_experts=8, top_k=1, dtype=dtype, experts=experts)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_out_of_range_ids_are_dropped(dtype):
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 8, size=(48, 3))
    experts[::3, 0] = -1
    experts[1::4, 2] = 8
    experts[5] = [-7, 100, 8]  # a token with every pair dropped
    check_parity(tokens=48, hidden=64, inter=32, num_experts=8, top_k=3, dtype=dtype, experts=experts)
    x, weights, ids, w_gate_up, w_down, dy = make_problem(48, 64, 32, 8, 3, dtype, experts=experts)
    y, (dx, d_weights, _, _) = jax.jit(lambda *a: run_with_grads(cuda_fn, *a))(x, weights, ids, w_gate_up,
                                                                                w_down, dy)
    assert np.all(np.asarray(y[5], np.float32) == 0) and np.all(np.asarray(dx[5], np.float32) == 0)
    assert np.all(np.asarray(d_weights)[experts < 0] == 0) and np.all(np.asarray(d_weights)[experts >= 8] == 0)


def test_layout_matches_cpu_kernels():
    experts = jax.random.randint(_key(), (333, 4), -1, 17)
    gpu = jax.jit(lambda e: moe_ops.moe_layout(e, 16, "cuda"))(experts)
    on_cpu = jax.device_put(np.asarray(experts), jax.devices("cpu")[0])
    cpu = jax.jit(lambda e: moe_ops.moe_layout(e, 16, "cpu"))(on_cpu)
    for got, want in zip(gpu, cpu):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bitwise_deterministic(dtype):
    problem = make_problem(1024, 256, 128, 16, 4, dtype, "zipf")
    fn = jax.jit(lambda *a: run_with_grads(cuda_fn, *a))
    first = jax.tree.leaves(fn(*problem))
    second = jax.tree.leaves(fn(*problem))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_jit_and_checkpoint_match_plain_grad():
    x, weights, experts, w_gate_up, w_down, dy = make_problem(256, 128, 64, 8, 2, jnp.bfloat16)

    def loss(a, w, g, d):
        y = cuda_fn(a, w, experts, g, d).astype(jnp.float32)
        return jnp.sum(y * dy.astype(jnp.float32))

    plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, weights, w_gate_up, w_down)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3)))(x, weights, w_gate_up, w_down)
    for a, b in zip(plain, remat):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_backward_passes_sharing_one_forward():
    """The backward writes dz over its gate_up operand (an aliased result, handlers.h): backward passes that
    share one forward must each still read the forward's gate_up (XLA copies it for all but the last), in one
    jit and eagerly, and give the gradients of separate forward+backward calls bit for bit."""
    x, weights, experts, w_gate_up, w_down, dy = make_problem(512, 128, 64, 8, 2, jnp.bfloat16, "zipf")
    cotangents = (dy, (-2 * dy.astype(jnp.float32)).astype(dy.dtype))

    def shared(*args):
        _, vjp = jax.vjp(lambda a, w, g, d: cuda_fn(a, w, experts, g, d), *args)
        return [vjp(ct) for ct in cotangents]

    args = (x, weights, w_gate_up, w_down)
    one_pass = jax.jit(lambda *a: run_with_grads(cuda_fn, *a))
    separate = [one_pass(x, weights, experts, w_gate_up, w_down, ct)[1] for ct in cotangents]
    for got in (jax.jit(shared)(*args), shared(*args)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(separate)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_auto_backend_uses_cuda_and_matches():
    x, weights, experts, w_gate_up, w_down, _ = make_problem(64, 64, 32, 4, 2, jnp.float32)
    y_auto = jmm.moe_ffn(x, weights, experts, w_gate_up, w_down)
    y_cuda = cuda_fn(x, weights, experts, w_gate_up, w_down)
    np.testing.assert_array_equal(np.asarray(y_auto), np.asarray(y_cuda))


def test_unsupported_dtype_raises():
    x, weights, experts, w_gate_up, w_down, _ = make_problem(8, 16, 8, 2, 1, jnp.float16)
    with pytest.raises(TypeError, match="cuda"):
        cuda_fn(x, weights, experts, w_gate_up, w_down)


# Runs forward+backward (bf16 tensor-core path and float32 SIMT path) on two inputs each, in a fresh process
# whose XLA_FLAGS are given, and saves every output.
_GRAPH_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
import jax_megamoe as jmm
out = {}
for dtype, (t, h, i, e, k) in ((jnp.bfloat16, (512, 256, 128, 16, 4)), (jnp.float32, (96, 40, 24, 6, 2))):
    @jax.jit
    def step(x, weights, experts, w_gate_up, w_down, dy):
        y, vjp = jax.vjp(lambda a, w, g, d: jmm.moe_ffn(a, w, experts, g, d, backend="cuda"),
                         x, weights, w_gate_up, w_down)
        return (y, *vjp(dy))
    for seed in (0, 1):
        ks = jax.random.split(jax.random.PRNGKey(seed), 6)
        experts = jax.lax.top_k(jax.random.gumbel(ks[0], (t, e)), k)[1].astype(jnp.int32)
        weights = jax.nn.softmax(jax.random.normal(ks[1], (t, k)), axis=-1)
        args = (jax.random.normal(ks[2], (t, h)).astype(dtype), weights, experts,
                (jax.random.normal(ks[3], (e, h, 2 * i)) / h**0.5).astype(dtype),
                (jax.random.normal(ks[4], (e, i, h)) / i**0.5).astype(dtype), jax.random.normal(ks[5], (t, h)).astype(dtype))
        for j, value in enumerate(step(*args)):
            out[f"{jnp.dtype(dtype).name}_{seed}_{j}"] = np.asarray(value.astype(jnp.float32))
from jax_megamoe import _ffi
recorded = _ffi.extension().cuda_graph_recorded_calls()
np.savez(sys.argv[1], recorded=np.array([recorded[op] for op in ("moe_layout", "moe_gate_up", "moe_down", "moe_backward")]), **out)
"""


def _run_graph_script(tmp_path, name, xla_flags):
    out = tmp_path / f"{name}.npz"
    env = dict(os.environ, XLA_FLAGS=xla_flags)
    proc = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT, str(out)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


def test_cuda_graph_capture_matches_uncaptured_run(tmp_path):
    """The handlers claim command-buffer compatibility (their temporaries are a workspace result): with custom
    calls forced into command buffers, XLA records the MoE calls into CUDA graphs (the extension counts calls
    made while their stream was capturing), and every output, on two inputs per dtype (a recorded graph
    replayed with other buffers), equals the run without command buffers bit for bit."""
    captured = _run_graph_script(tmp_path, "captured",
                                 "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
    plain = _run_graph_script(tmp_path, "plain", "--xla_gpu_enable_command_buffer=")
    assert np.all(captured["recorded"] > 0), f"calls recorded (layout, gate_up, down, backward): {captured['recorded']}"
    assert np.all(plain["recorded"] == 0), f"recorded without command buffers: {plain['recorded']}"
    outputs = sorted(set(plain.files) - {"recorded"})
    assert sorted(set(captured.files) - {"recorded"}) == outputs and len(outputs) == 2 * 2 * 5
    for name in outputs:
        np.testing.assert_array_equal(captured[name], plain[name], err_msg=name)
