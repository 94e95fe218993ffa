"""The "fp8_blockwise" recipe's CUDA grouped GEMM (`ops.fp8.fp8_rows_gemm`, marker `gpu`) against the dequantised
float32 product of the same quantised operands: the FP8 tensor cores compute the e4m3 products exactly in float32
and scale the partial sums per 128-deep block, so only the summation order and the bf16 output differ."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from moe_cases import seeded_rng

from jax_megamoe.ops import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs an NVIDIA GPU"),
]


def grouped_problem(seed, counts, n, k):
    rng = seeded_rng("fp8 rows gemm", seed)
    rows, experts = int(sum(counts)), len(counts)
    x = rng.standard_normal((rows, k)) * rng.uniform(0.1, 10.0, (rows, 1))  # rows of very different ranges
    w = rng.standard_normal((experts, n, k)) / np.sqrt(k)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(offsets)


def reference(a, sfa, b, sfb, offsets):
    """float64 numpy: each row's product with its expert's dequantised weights."""
    x = np.asarray(fp8.dequantize(a, sfa, (1, fp8.BLOCK)), np.float64)
    w = np.asarray(fp8.dequantize(b, sfb, (1, fp8.BLOCK, fp8.BLOCK)), np.float64)
    out = np.zeros((x.shape[0], w.shape[1]))
    for e in range(w.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = x[lo:hi] @ w[e].T
    return out


@pytest.mark.parametrize(
    "counts, n, k",
    [
        ([300, 0, 129, 1, 77], 256, 384),  # an empty expert, a one-row expert, ragged tiles
        ([0, 0, 512], 128, 128),  # every row on the last expert
        ([1], 128, 2048),  # one row, deep K
        ([200] * 16, 768, 256),
    ],
)
def test_matches_the_dequantised_product(counts, n, k):
    x, w, offsets = grouped_problem(str((counts, n, k)), counts, n, k)
    a, sfa = fp8.quantize(x, (1, fp8.BLOCK))
    b, sfb = fp8.quantize(w, (1, fp8.BLOCK, fp8.BLOCK))
    got = np.asarray(jax.jit(fp8.fp8_rows_gemm)(a, sfa, b, sfb, offsets), np.float64)
    want = reference(a, sfa, b, sfb, offsets)
    assert np.all(np.isfinite(got))
    # bf16 output rounding (2**-9 relative per entry), plus float32 summation order
    assert np.linalg.norm(got - want) <= 4e-3 * np.linalg.norm(want)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_bad_shapes_are_refused_before_any_kernel():
    a = jnp.zeros((8, 100), fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8.fp8_rows_gemm(
            a, jnp.ones((8, 1)), jnp.zeros((2, 128, 100), fp8.FP8_DTYPE), jnp.ones((2, 1, 1)), jnp.asarray([0, 4, 8])
        )


def weight_reference(a, sfa, b, sfb, token_offsets, num_experts):
    """float64 numpy: each expert's product over its padded tokens, with the scales of its token tiles."""
    m, n = a.shape[0], b.shape[0]
    out = np.zeros((num_experts, m, n))
    for e in range(num_experts):
        lo, hi = int(token_offsets[e]), int(token_offsets[e + 1])
        tiles = (hi - lo) // fp8.BLOCK
        if not tiles:
            continue
        scale_a = np.repeat(np.asarray(sfa)[lo // fp8.BLOCK : hi // fp8.BLOCK].T, fp8.BLOCK, 1)
        scale_b = np.repeat(np.asarray(sfb)[lo // fp8.BLOCK : hi // fp8.BLOCK].T, fp8.BLOCK, 1)
        out[e] = (np.asarray(a[:, lo:hi], np.float64) * scale_a) @ (np.asarray(b[:, lo:hi], np.float64) * scale_b).T
    return out


@pytest.mark.parametrize(
    "counts, m, n",
    [
        ([300, 0, 129, 1, 77], 256, 384),  # an empty expert, a one-row expert, ragged token tiles
        ([0, 0, 512], 128, 128),
        ([200] * 8, 768, 256),
    ],
)
def test_weight_gemm_matches_the_dequantised_product(counts, m, n):
    rng = seeded_rng("fp8 weight gemm", str((counts, m, n)))
    rows = int(sum(counts))
    x = rng.standard_normal((rows, m)) * rng.uniform(0.1, 10.0, (rows, 1))
    dz = rng.standard_normal((rows, n))
    a, sfa, offsets = fp8.expert_tiles(x, np.asarray(counts))
    b, sfb, _ = fp8.expert_tiles(dz, np.asarray(counts))
    a8, b8 = (jnp.asarray(v).astype(fp8.FP8_DTYPE) for v in (a, b))  # exact: the values are e4m3 already
    got = jax.jit(fp8.fp8_weight_gemm, static_argnums=5)(
        a8, jnp.asarray(sfa), b8, jnp.asarray(sfb), jnp.asarray(offsets), len(counts)
    )
    got = np.asarray(got, np.float64)
    want = weight_reference(a, sfa, b, sfb, offsets, len(counts))
    assert np.all(np.isfinite(got))
    for e, count in enumerate(counts):
        if count == 0:
            assert np.all(got[e] == 0), e  # no tiles ran: the zeroed output
    assert np.linalg.norm(got - want) <= 4e-3 * np.linalg.norm(want)
