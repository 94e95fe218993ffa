"""Every GEMM tile configuration of the CUDA implementation against the float32 reference (marker `gpu`).

The tiles are an explicit `jmm.GemmConfig` passed as `moe_ffn(..., gemm_config=...)` (the default, None, is
the shape heuristic `GemmConfig.for_problem`), carried to the handlers as int64 attributes. Each
configuration is a fresh jit of the same function. bf16 only (float32 takes the SIMT path, which has no
tiles); forward and all four gradients, normwise relative error <= 1e-2 against the float32 reference, every
value finite. Run on an H200 by scripts/gpu_check.sh. (CPU: tests/test_cuda_lowering.py checks the
attributes each call carries.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import (
    OUTPUT_NAMES,
    TOLERANCE,
    Case,
    make_problem,
    reference_value_and_grads,
    rel_error,
    seeded_rng,
    value_and_grads,
)

import jax_megamoe as jmm
from jax_megamoe.ops.gemm_config import GemmConfig, GemmTiles

pytestmark = pytest.mark.gpu

GEMMS = ("fwd_gate_up", "fwd_down", "bwd_down", "bwd_gate_up")
TILES = tuple(GemmTiles)
# None (the heuristic), each tiles on every row-grouped GEMM, then GEMM-by-GEMM mixes of all of them.
CONFIGS = {"heuristic": None}
CONFIGS |= {t.name: GemmConfig(t, t, t, t) for t in TILES}
CONFIGS |= {
    f"mix{shift}": GemmConfig(*(TILES[(g + shift) % len(TILES)] for g in range(len(GEMMS))))
    for shift in range(1, len(TILES))
}

ROW_TILE_EDGES = (63, 64, 65, 0, 127, 128, 129, 1, 255, 256, 257)
# name: (case, explicit rows per expert or None)
CASES = {
    # Several row and column tiles per expert, ragged expert sizes (about 256 rows each, or Zipf-skewed).
    "multi_tile_uniform": (Case(2048, 512, 384, 32, 4), None),
    "multi_tile_zipf": (Case(2048, 512, 384, 32, 4, "zipf"), None),
    # Expert sizes on both sides of the 64- and 128-row tile edges, one expert without rows (K = 1).
    "row_tile_edges": (Case(sum(ROW_TILE_EDGES), 256, 128, 11, 1), ROW_TILE_EDGES),
    # H, I multiples of 8 but not of the 64-deep contraction tile; fewer rows than one tile per expert.
    "ragged_contraction": (Case(96, 200, 72, 16, 2), None),
    # Decode sizes: a few rows per expert, some experts empty, several column slices per expert; one token.
    "decode_rows": (Case(24, 512, 192, 64, 8), None),
    "one_token": (Case(1, 256, 128, 16, 4), None),
}


@functools.cache
def problem_and_reference(case_name):
    """The case's bf16 problem `(args, dy)` and its float32 reference outputs (computed once per case)."""
    case, rows = CASES[case_name]
    experts = None
    if rows is not None:
        assert sum(rows) == case.tokens
        ids = np.repeat(np.arange(case.experts), rows)
        experts = seeded_rng("row tile edges").permutation(ids)[:, None].astype(np.int32)
    args, dy = make_problem(case, jnp.bfloat16, seed=("gemm tiles", case_name), experts=experts)
    return args, dy, reference_value_and_grads(args, dy)


def cuda_value_and_grads(args, dy, gemm_config):
    """A fresh jit with the tiles of `gemm_config` fixed in the program."""
    fn = functools.partial(jmm.moe_ffn, implementation="cuda", gemm_config=gemm_config)
    return jax.jit(functools.partial(value_and_grads, fn))(args, dy)


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("case_name", CASES)
def test_tiles_match_reference(case_name, config_name):
    args, dy, want = problem_and_reference(case_name)
    got = jax.block_until_ready(cuda_value_and_grads(args, dy, CONFIGS[config_name]))
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        g = np.asarray(g.astype(jnp.float32))
        assert np.all(np.isfinite(g)), f"{config_name}, {name}: non-finite values (unwritten or NaN output)"
        err = rel_error(g, w)
        assert err <= TOLERANCE["bfloat16"], f"{config_name}, {name}: normwise relative error {err:.3g} > 1e-2"


@pytest.mark.parametrize("case_name", CASES)
def test_the_default_is_the_heuristics_config(case_name):
    """gemm_config=None and the heuristic's GemmConfig passed explicitly give the same bits."""
    args, dy, _ = problem_and_reference(case_name)
    case, _ = CASES[case_name]
    explicit = GemmConfig.for_problem(case.tokens, case.top_k, case.hidden, case.inter, case.experts)
    assert isinstance(explicit, GemmConfig)
    for a, b in zip(cuda_value_and_grads(args, dy, None), cuda_value_and_grads(args, dy, explicit), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
