"""The "fp8_blockwise" recipe on CUDA (marker `gpu`): its two grouped GEMMs (`ops.fp8_cuda`) against the float64
product of the same quantised operands (the FP8 tensor cores compute the e4m3 products exactly in float32 and scale
the partial sums per 128-deep block, so only the summation order and the output rounding differ), and
the CUDA weight quantiser against the rule bit for bit, and `moe_ffn(..., implementation="cuda",
recipe="fp8_blockwise")` through the shared test base (tests/fp8_cases.py) against the numpy oracle of
the quantised math, on device memory poisoned with NaN before each call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fp8_cases import (
    Fp8KernelsBase,
    block_quantizer_problem,
    np_quantize_blocks,
    np_quantize_rows,
    np_quantize_tiles,
    np_tile_dots,
    parametrize_cases,
    tile_dots_problem,
)
from moe_cases import Case, seeded_rng

from jax_megamoe.ops import fp8, fp8_cuda

pytestmark = pytest.mark.gpu


# Normwise, against float64: Hopper's FP8 MMA accumulates each 128-deep block at reduced precision before CUTLASS
# scales and adds it in float32 (about 1e-4 relative here); bf16 output adds its rounding (2**-9 per entry).
TOLERANCE = {jnp.bfloat16: 4e-3, jnp.float32: 1e-3}


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
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_matches_the_dequantised_product(counts, n, k, out_dtype):
    x, w, offsets = grouped_problem(str((counts, n, k)), counts, n, k)
    a, sfa = fp8.quantize(x, (1, fp8.BLOCK))
    b, sfb = fp8.quantize(w, (1, fp8.BLOCK, fp8.BLOCK))
    got = jax.jit(fp8_cuda.rows_gemm, static_argnums=5)(a, sfa, b, sfb, offsets, out_dtype)
    assert got.dtype == out_dtype
    got = np.asarray(got, np.float64)
    want = reference(a, sfa, b, sfb, offsets)
    assert np.all(np.isfinite(got))
    tolerance = TOLERANCE[out_dtype]
    assert np.linalg.norm(got - want) <= tolerance * np.linalg.norm(want)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_bad_shapes_are_refused_before_any_kernel():
    a = jnp.zeros((8, 100), fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_cuda.rows_gemm(
            a, jnp.ones((8, 1)), jnp.zeros((2, 128, 100), fp8.FP8_DTYPE), jnp.ones((2, 1, 1)), jnp.asarray([0, 4, 8])
        )


def expert_tiles(rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(values [C, P], scales [P/128, C], token_offsets [E + 1])`: `rows [R, C]` (expert-sorted, `counts[e]` rows
    of expert e) transposed to token-contiguous columns, each expert's rows padded with zeros to a multiple of 128,
    quantised in 1x128 tiles along the tokens, as `fp8_cuda.weight_gemm` takes them (numpy, one expert at a time)."""
    counts = np.asarray(counts)
    padded = -(-counts // fp8.BLOCK) * fp8.BLOCK
    token_offsets = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)])
    cols = rows.shape[1]
    values, scales = [np.zeros((cols, 0), np.float32)], [np.zeros((0, cols), np.float32)]
    for e in range(len(counts)):
        block = np.zeros((cols, padded[e]), np.float32)
        block[:, : counts[e]] = rows[starts[e] : starts[e + 1]].T
        if padded[e]:
            v, s = fp8.quantize(jnp.asarray(block), (1, fp8.BLOCK))
            values.append(np.asarray(v.astype(jnp.float32)))
            scales.append(np.asarray(s).T)
    return np.concatenate(values, axis=1), np.concatenate(scales, axis=0), token_offsets


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
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_weight_gemm_matches_the_dequantised_product(counts, m, n, out_dtype):
    rng = seeded_rng("fp8 weight gemm", str((counts, m, n)))
    rows = int(sum(counts))
    x = rng.standard_normal((rows, m)) * rng.uniform(0.1, 10.0, (rows, 1))
    dz = rng.standard_normal((rows, n))
    a, sfa, offsets = expert_tiles(x, np.asarray(counts))
    b, sfb, _ = expert_tiles(dz, np.asarray(counts))
    # 128 columns past the last expert's hold NaN: the kernel must not read them
    unread = ((0, 0), (0, fp8.BLOCK))
    a8, b8 = (
        jnp.asarray(np.pad(v, unread, constant_values=np.nan)).astype(fp8.FP8_DTYPE) for v in (a, b)
    )  # exact: the values are e4m3 already
    sfa8, sfb8 = (jnp.asarray(np.pad(v, ((0, 1), (0, 0)), constant_values=np.nan)) for v in (sfa, sfb))
    got = jax.jit(fp8_cuda.weight_gemm, static_argnums=(5, 6))(
        a8, sfa8, b8, sfb8, jnp.asarray(offsets), len(counts), out_dtype
    )
    assert got.dtype == out_dtype
    got = np.asarray(got, np.float64)
    want = weight_reference(a, sfa, b, sfb, offsets, len(counts))
    assert np.all(np.isfinite(got))
    for e, count in enumerate(counts):
        if count == 0:
            assert np.all(got[e] == 0), e  # no tiles ran: the zeroed output
    assert np.linalg.norm(got - want) <= TOLERANCE[out_dtype] * np.linalg.norm(want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("transpose", [False, True])
def test_weight_quantizer_is_the_rule_bit_for_bit(dtype, transpose):
    # XLA's quantiser on GPUs is not (its division is not correctly rounded); tests/test_fp8.py holds the CPU's
    w = block_quantizer_problem(dtype, transpose)
    values, scales = jax.jit(fp8_cuda.weight_blocks, static_argnums=1)(jnp.asarray(w, dtype), transpose)
    want_values, want_scales = np_quantize_blocks(w, transpose)
    assert values.dtype == fp8.FP8_DTYPE and values.shape == want_values.shape
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(values).astype(np.float32), want_values)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_transposed_forward_blocks_are_the_backwards_bit_for_bit(dtype):
    """The CUDA quantiser's forward blocks (the weights transposed) transposed by XLA are its backward blocks, bit for
    bit: what the backward may take instead of quantising again (docs/fp8.md, weights once)."""
    w = jnp.asarray(block_quantizer_problem(dtype, False), dtype)
    quantize = jax.jit(fp8_cuda.weight_blocks, static_argnums=1)
    got = jax.jit(fp8.transpose_blocks)(*quantize(w, True))
    for a, b in zip(got, quantize(w, False), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_routing_weight_gradient_order_on_the_gpu():
    """`fp8.row_dots`, the op's d weights, compiled for the GPU: numpy's statement of its order bit for bit (no
    product fused into an add, no order of XLA's choosing), so that every program computes the same d weights."""
    h, g = tile_dots_problem("gpu")
    want = np_tile_dots(h, g)
    np.testing.assert_array_equal(np.asarray(jax.jit(fp8.tile_dots)(h, g)).view(np.uint32), want.view(np.uint32))
    rows = np.asarray(jax.jit(fp8.row_dots)(h, g))
    np.testing.assert_array_equal(rows.view(np.uint32), ((want[:, 0] + want[:, 1]) + want[:, 2]).view(np.uint32))


def test_row_quantizer_is_the_rule_bit_for_bit():
    rng = seeded_rng("fp8 quantize rows")
    tokens, cols = 300, 384
    a = rng.standard_normal((tokens, cols)) * np.exp(rng.uniform(-6, 6, (tokens, 1)))
    a[7, 128:256] = 0  # an all-zero tile: scale 1
    a = np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
    index = rng.integers(0, tokens, 1000).astype(np.int32)
    index[::97] = tokens  # padding rows (the layout's): zero values, scale 1
    values, scales = jax.jit(fp8_cuda.row_operand)(jnp.asarray(a, jnp.bfloat16), jnp.asarray(index))
    rows = np.where(((index >= 0) & (index < tokens))[:, None], a[np.clip(index, 0, tokens - 1)], 0)
    want_values, want_scales = np_quantize_rows(rows)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(values).astype(np.float64), want_values)


def assert_near_the_rule(values, scales, want_rows, used):
    """A SwiGLU pass's tiles against the rule applied to numpy's rows: the rows past `used` zero with scale 1, at
    least 99.9% of the values equal, and within 1e-3 in norm (float32's exp may differ from numpy's by an ulp)."""
    want_values, want_scales = np_quantize_rows(want_rows)
    got_values = np.asarray(values).astype(np.float64)
    assert np.all(got_values[used:] == 0) and np.all(np.asarray(scales)[used:] == 1)
    assert np.mean(got_values == want_values) > 0.999
    got = got_values.reshape(want_rows.shape[0], -1, 128) * np.asarray(scales)[..., None]
    want = want_values.reshape(want_rows.shape[0], -1, 128) * want_scales[..., None]
    assert np.linalg.norm(got - want) <= 1e-3 * np.linalg.norm(want)


def test_swiglu_rows_are_the_rule():
    """h = bf16(silu(gate) * up) in 1x128 tiles; the rows past offsets[E] zero. SwiGLU's float32 exp may differ from
    numpy's by an ulp, which can move h to the next bf16 value and, rarely, a tile's e4m3 rounding: near, not bit
    for bit."""
    rng = seeded_rng("fp8 swiglu rows")
    rows, inter, used = 640, 256, 500
    gate_up = np.asarray(jnp.asarray(rng.standard_normal((rows, 2 * inter)) * 3, jnp.bfloat16).astype(jnp.float32))
    offsets = jnp.asarray([0, 256, 384, used], jnp.int32)
    values, scales = jax.jit(fp8_cuda.hidden)(jnp.asarray(gate_up, jnp.bfloat16), offsets)
    gate, up = gate_up[:, :inter].astype(np.float64), gate_up[:, inter:].astype(np.float64)
    h = (gate / (1 + np.exp(-gate)) * up).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    h[used:] = 0
    assert_near_the_rule(values, scales, h, used)


def test_swiglu_grad_rows_are_the_rule():
    """dz = SwiGLU'(gate, up) applied to w * g in float32, in 1x128 tiles along 2I; the rows past offsets[E] zero.
    float32 exp may differ from numpy's by an ulp: near, not bit for bit."""
    rng = seeded_rng("fp8 swiglu grad rows")
    rows, inter, used = 640, 256, 500
    gate_up = np.asarray(jnp.asarray(rng.standard_normal((rows, 2 * inter)) * 3, jnp.bfloat16).astype(jnp.float32))
    g = rng.standard_normal((rows, inter)).astype(np.float32)
    w = rng.uniform(0, 1, rows).astype(np.float32)
    offsets = jnp.asarray([0, 256, 384, used], jnp.int32)
    values, scales = jax.jit(fp8_cuda.hidden_grad)(
        jnp.asarray(gate_up, jnp.bfloat16), jnp.asarray(g), jnp.asarray(w), offsets
    )
    gate, up = gate_up[:, :inter].astype(np.float64), gate_up[:, inter:].astype(np.float64)
    sig = 1 / (1 + np.exp(-gate))
    dh = w[:, None].astype(np.float64) * g
    dz = np.concatenate([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], axis=1).astype(np.float32)
    dz[used:] = 0
    assert_near_the_rule(values, scales, dz, used)


def np_token_tiles(values, scales, factor):
    """The rule in float32 numpy: factor * (values * scale) requantised in 1x128 tiles along the rows, transposed."""
    rows, cols = values.shape
    d = values.astype(np.float32) * np.repeat(scales, 128, axis=1).astype(np.float32)
    d = factor[:, None].astype(np.float32) * d
    out, scale = np_quantize_tiles(d.reshape(rows // 128, 128, cols), 1)
    return out.reshape(rows, cols).T, scale[:, 0, :]


@pytest.mark.parametrize("with_factor", [False, True])
def test_token_tiles_are_the_rule_bit_for_bit(with_factor):
    rng = seeded_rng("fp8 token tiles", with_factor)
    rows, cols = 512, 384
    a = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-4, 4, (rows, 1)))
    a[256:384] = 0  # an all-zero tile of rows: scale 1
    values, scales = fp8.quantize(jnp.asarray(a, jnp.float32), (1, fp8.BLOCK))
    factor = rng.uniform(0, 1, rows).astype(np.float32) if with_factor else np.ones(rows, np.float32)
    got_values, got_scales = jax.jit(fp8_cuda.token_tiles)(values, scales, jnp.asarray(factor) if with_factor else None)
    want_values, want_scales = np_token_tiles(np.asarray(values).astype(np.float32), np.asarray(scales), factor)
    np.testing.assert_array_equal(np.asarray(got_scales), want_scales)
    np.testing.assert_array_equal(np.asarray(got_values).astype(np.float32), want_values)


pytest_generate_tests = parametrize_cases


@jax.jit
def _nan_block():
    return jnp.full((1 << 28,), jnp.nan, jnp.float32)  # 1 GiB


class TestCudaKernels(Fp8KernelsBase):
    implementation = "cuda"
    cases = (
        *Fp8KernelsBase.cases,
        Case(2048, 1024, 384, 16, 4, "zipf"),  # q30-like at a larger size: many token tiles per expert
        Case(1000, 2000, 700, 12, 3, "empty_experts"),  # odd sizes
    )

    def prepare(self):
        # Memory XLA hands out next held NaN: a row or tile the kernels fail to write shows as a non-finite value.
        _nan_block().block_until_ready().delete()
