"""The "fp8_blockwise" recipe's kernels emulated in XLA, what `implementation="cpu"` runs: the contracts of
`fp8_cuda`, function for function, with the two GEMMs in float32 on the dequantised operands (the same outputs up
to the float32 summation order) and the quantising passes as XLA's fusions of the rule (`fp8.quantize`), so that CI
runs every step around the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_megamoe import _ffi
from jax_megamoe.ops import fp8
from jax_megamoe.ops.fp8 import BLOCK, dequantize, gemm_out_dtype, quantize
from jax_megamoe.reference import swiglu

_HIGHEST = jax.lax.Precision.HIGHEST


def _tile_experts(offsets: jax.Array, tiles: int) -> jax.Array:
    """The group of each 128-row (or 128-column) tile given group offsets that are multiples of 128: E past the
    last group's."""
    starts = jnp.arange(tiles, dtype=jnp.int32) * BLOCK
    return (jnp.searchsorted(offsets.astype(jnp.int32), starts, side="right") - 1).astype(jnp.int32)


def rows_gemm(a, sfa, b, sfb, expert_offsets, out_dtype=jnp.bfloat16):
    """`fp8_cuda.rows_gemm` (rows past `expert_offsets[E]` are zero), for the op's padded layout (offsets
    multiples of 128): one 128-row tile at a time, each within one expert's rows, so that no temporary grows with
    the rows times E (XLA:CPU expands a ragged_dot over all groups)."""
    rows, depth = a.shape
    experts, n, _ = b.shape
    weights = dequantize(b, sfb, (1, BLOCK, BLOCK))  # [E, N, K]

    def one_tile(args):
        a_t, sfa_t, e = args
        out = jnp.matmul(
            dequantize(a_t, sfa_t, (1, BLOCK)),
            weights[jnp.minimum(e, experts - 1)].T,
            precision=_HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return jnp.where(e < experts, out, 0).astype(gemm_out_dtype(out_dtype))

    tiles = rows // BLOCK
    by_tile = (
        a.reshape(tiles, BLOCK, depth),
        sfa.reshape(tiles, BLOCK, depth // BLOCK),
        _tile_experts(expert_offsets, tiles),
    )
    return jax.lax.map(one_tile, by_tile).reshape(rows, n)


def weight_gemm(a, sfa, b, sfb, token_offsets, num_experts, out_dtype=jnp.bfloat16):
    """`fp8_cuda.weight_gemm`: each 128-token tile's product added to its expert's sum, tiles in order (so the
    same tiles give the same sums, however many other columns there are)."""
    m, tokens = a.shape
    n = b.shape[0]

    def add_tile(sums, args):
        a_t, sfa_t, b_t, sfb_t, e = args  # [M, 128], [M], [N, 128], [N], the tile's expert
        product = jnp.matmul(
            a_t.astype(jnp.float32) * sfa_t[:, None],
            (b_t.astype(jnp.float32) * sfb_t[:, None]).T,
            precision=_HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return sums.at[e].add(product), None  # expert E: the columns past the last expert's, dropped

    tiles = tokens // BLOCK
    by_tile = (
        jnp.moveaxis(a.reshape(m, tiles, BLOCK), 1, 0),
        sfa,
        jnp.moveaxis(b.reshape(n, tiles, BLOCK), 1, 0),
        sfb,
        _tile_experts(token_offsets, tiles),
    )
    zeros = _ffi.vary_alike(a, jnp.zeros((num_experts + 1, m, n), jnp.float32))[1]  # varying as the tiles' sums
    sums, _ = jax.lax.scan(add_tile, zeros, by_tile)
    return sums[:num_experts].astype(gemm_out_dtype(out_dtype))


def weight_blocks(w: jax.Array, transpose: bool) -> tuple[jax.Array, jax.Array]:
    """`fp8_cuda.weight_blocks`: square blocks, so quantising then transposing equals transposing then
    quantising."""
    return quantize(jnp.swapaxes(w, 1, 2) if transpose else w, (1, BLOCK, BLOCK))


def row_operand(a: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`fp8_cuda.row_operand`: `a [T, C]` quantised in 1x128 tiles per token, then its rows `index` (past T: zero
    values, scale 1)."""
    return fp8.take_rows(*quantize(a, (1, BLOCK)), index)


def _used(rows: jax.Array, offsets: jax.Array) -> jax.Array:
    """`rows` with the rows past the last expert's (which the rows GEMM does not write) set to zero."""
    return jnp.where((jnp.arange(rows.shape[0]) < offsets[-1])[:, None], rows, 0)


def hidden(gate_up: jax.Array, offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`fp8_cuda.hidden`: q(h), the SwiGLU of the projections rounded to bf16 (x's dtype), the rows past the last
    expert's zero, quantised along I."""
    h = fp8.round_to(swiglu(gate_up.astype(jnp.float32)), jnp.bfloat16)
    return quantize(_used(h, offsets), (1, BLOCK))


def token_tiles(values: jax.Array, scales: jax.Array, row_factor=None) -> tuple[jax.Array, jax.Array]:
    """`fp8_cuda.token_tiles`: `row_factor [R] * dequantize(values, scales)` (factor 1 when None) requantised in
    1x128 tiles along the rows, values `[C, R]`, scales `[R/128, C]`."""
    rows = dequantize(values, scales, (1, BLOCK))
    if row_factor is not None:
        rows = row_factor[:, None] * rows
    tiles = rows.reshape(rows.shape[0] // BLOCK, BLOCK, rows.shape[1])
    out_scales = fp8.tile_scale(jnp.max(jnp.abs(tiles), axis=1))
    out = fp8.to_fp8(tiles, out_scales[:, None, :]).reshape(rows.shape)
    return out.T, out_scales


def hidden_grad(gate_up, g, row_weights, offsets) -> tuple[jax.Array, jax.Array]:
    """`fp8_cuda.hidden_grad`: q(dz), SwiGLU's derivative at the projections applied to `row_weights * g` in
    float32, the rows past the last expert's zero, quantised along 2I."""
    dz = fp8.swiglu_grad(gate_up.astype(jnp.float32), row_weights[:, None] * g)
    return quantize(_used(dz, offsets), (1, BLOCK))
