"""Every GEMM tile configuration of the CUDA backend against the float32 reference (marker `gpu`).

JMM_GEMM_TILES is read when moe_ffn is traced (grammar in cuda/include/jmm/gemm_tiles.h), so each configuration
is a fresh jit of the same function. bf16 only (float32 takes the SIMT path, which has no tiles); forward
and all four gradients, normwise relative error <= 1e-2 against the float32 reference, every value finite.
Run on an H200 by scripts/gpu_check.sh.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_megamoe as jmm
from moe_cases import TOLERANCE, random_problem, reference_value_and_grads, rel_error, value_and_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs an NVIDIA GPU"),
]

ENV = "JMM_GEMM_TILES"
# Each configuration on every row-grouped GEMM, then one GEMM-by-GEMM mix of all of them.
TILE_SPECS = (
    "default",
    "coop128x256_c2",
    "coop128x256_c1",
    "pp64x256_c1",
    "fwd_gate_up=pp64x256_c1,fwd_down=coop128x256_c2,bwd_down=default,bwd_gate_up=pp64x256_c1",
)
OUTPUTS = ("y", "dx", "d_weights", "d_w_gate_up", "d_w_down")

# name: (tokens, hidden, inter, experts, top_k, routing or explicit rows per expert)
CASES = {
    # Several row and column tiles per expert, ragged expert sizes (about 256 rows each, or Zipf-skewed).
    "multi_tile_uniform": (2048, 512, 384, 32, 4, "uniform"),
    "multi_tile_zipf": (2048, 512, 384, 32, 4, "zipf"),
    # Expert sizes on both sides of the 64- and 128-row tile edges, one expert without rows (K = 1).
    "row_tile_edges": (None, 256, 128, 11, 1, (63, 64, 65, 0, 127, 128, 129, 1, 255, 256, 257)),
    # H, I multiples of 8 but not of the 64-deep contraction tile; fewer rows than one tile per expert.
    "ragged_contraction": (96, 200, 72, 16, 2, "uniform"),
}


def cuda_fn(x, weights, experts, w_gate_up, w_down):
    return jmm.moe_ffn(x, weights, experts, w_gate_up, w_down, backend="cuda")


@functools.lru_cache(maxsize=None)
def problem_and_reference(case_name):
    """The case's bf16 problem `(args, dy)` and its float32 reference outputs (computed once per case)."""
    tokens, hidden, inter, experts, top_k, routing = CASES[case_name]
    if isinstance(routing, tuple):
        ids = np.repeat(np.arange(experts), routing)
        ids = np.random.default_rng(5).permutation(ids)[:, None].astype(np.int32)
        tokens = len(ids)
        log_p = jnp.zeros(experts)
    else:
        log_p = jnp.zeros(experts) if routing == "uniform" else -1.2 * jnp.log1p(jnp.arange(experts))
    seed = zlib.crc32(case_name.encode())
    args, dy = random_problem(seed, tokens, hidden, inter, experts, top_k, jnp.bfloat16, log_p)
    if isinstance(routing, tuple):
        args = (args[0], args[1], jnp.asarray(ids), *args[3:])  # the explicit expert sizes
    return args, dy, reference_value_and_grads(args, dy)


def cuda_value_and_grads(args, dy):
    """A fresh jit, traced (and so reading JMM_GEMM_TILES) now."""
    return jax.jit(lambda args, dy: value_and_grads(cuda_fn, args, dy))(args, dy)


@pytest.mark.parametrize("spec", TILE_SPECS)
@pytest.mark.parametrize("case_name", CASES)
def test_tiles_match_reference(monkeypatch, case_name, spec):
    args, dy, want = problem_and_reference(case_name)
    monkeypatch.setenv(ENV, spec)
    got = jax.block_until_ready(cuda_value_and_grads(args, dy))
    for name, g, w in zip(OUTPUTS, got, want):
        g = np.asarray(g.astype(jnp.float32))
        assert np.all(np.isfinite(g)), f"{spec}, {name}: non-finite values (unwritten or NaN output)"
        err = rel_error(g, w)
        assert err <= TOLERANCE["bfloat16"], f"{spec}, {name}: normwise relative error {err:.3g} > 1e-2"


@pytest.mark.parametrize("spec, message", [
    ("bogus", "unknown tiles"),
    ("fwd_down=pp64x256_c1,bwd_up=default", 'unknown GEMM "bwd_up"'),
    ("bwd_down=pp128x128_c2", 'unknown tiles "pp128x128_c2"'),
])
def test_bad_tile_spec_is_a_clear_error(monkeypatch, spec, message):
    args, dy, _ = problem_and_reference("ragged_contraction")
    monkeypatch.setenv(ENV, spec)
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"{ENV}=.*{message}"):
        jax.block_until_ready(cuda_value_and_grads(args, dy))
