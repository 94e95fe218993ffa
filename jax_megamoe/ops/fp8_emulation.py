"""The "fp8_blockwise" recipe's kernels emulated in XLA, what `implementation="cpu"` runs: the contracts of
`fp8_cuda`, function for function, with the two GEMMs in float32 on the dequantised operands (the same outputs up
to the float32 summation order) and the quantising passes as XLA's fusions of the rule (`fp8.quantize`), so that CI
runs every step around the kernels. At the end of the module: fused producers that write in one pass what several of
these passes write, specified here for CUDA kernels not yet written (docs/fp8.md, "Fused producers")."""

from __future__ import annotations

from collections.abc import Callable

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


def _rows_gemm_tiles(epilogue: Callable, a, sfa, b, sfb, expert_offsets, *row_operands):
    """The rows GEMM's loop, one 128-row tile at a time (each within one expert's rows, the op's padded layout):
    the tile's float32 accumulator `dequantize(a)[tile] @ dequantize(b[e])^T` and `epilogue(acc, used, *tiles)`,
    where `used` is whether the tile lies before `expert_offsets[E]` and `tiles` are the tile's rows of each of
    `row_operands`; the epilogue's results come back stacked over the tiles (a leading axis). One tile at a time, so
    that no temporary grows with the rows times E (XLA:CPU expands a ragged_dot over all groups)."""
    rows, depth = a.shape
    experts = b.shape[0]
    weights = dequantize(b, sfb, (1, BLOCK, BLOCK))  # [E, N, K]

    def one_tile(args):
        a_t, sfa_t, e, *operand_tiles = args
        acc = jnp.matmul(
            dequantize(a_t, sfa_t, (1, BLOCK)),
            weights[jnp.minimum(e, experts - 1)].T,
            precision=_HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return epilogue(acc, e < experts, *operand_tiles)

    tiles = rows // BLOCK
    by_tile = (
        a.reshape(tiles, BLOCK, depth),
        sfa.reshape(tiles, BLOCK, depth // BLOCK),
        _tile_experts(expert_offsets, tiles),
        *(x.reshape(tiles, BLOCK, *x.shape[1:]) for x in row_operands),
    )
    return jax.lax.map(one_tile, by_tile)


def rows_gemm(a, sfa, b, sfb, expert_offsets, out_dtype=jnp.bfloat16):
    """`fp8_cuda.rows_gemm` (rows past `expert_offsets[E]` are zero), for the op's padded layout (offsets
    multiples of 128)."""
    out_dtype = gemm_out_dtype(out_dtype)

    def epilogue(acc, used):
        return jnp.where(used, acc, 0).astype(out_dtype)

    return _rows_gemm_tiles(epilogue, a, sfa, b, sfb, expert_offsets).reshape(a.shape[0], b.shape[1])


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


# ---------------------------------------------------------------------------------------------------------------
# Fused producers: each writes what several of the passes above write today, in one pass over its input, computed
# as its CUDA kernel is to compute it (the same quantisation blocks, rounding points and orders). Their CUDA kernels
# are not written yet and `fp8_gemms` composes the passes above; tests/test_fp8.py holds each of these to those
# passes bit for bit (docs/fp8.md, "Fused producers").


def _assemble_token_tiles(values: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-tile token tiles (values `[tiles, C, 128]`, scales `[tiles, 1, C]`) as `token_tiles` lays them out:
    values `[C, R]`, scales `[R/128, C]`."""
    tiles, cols, _ = values.shape
    return jnp.moveaxis(values, 0, 1).reshape(cols, tiles * BLOCK), scales.reshape(tiles, cols)


def _by_row_tile(fn: Callable, *arrays):
    """`fn` on each 128-row tile of `arrays` (their rows a multiple of 128), results stacked over the tiles."""
    tiles = arrays[0].shape[0] // BLOCK
    return jax.lax.map(lambda t: fn(*t), tuple(a.reshape(tiles, BLOCK, *a.shape[1:]) for a in arrays))


def row_operand_tiles(a: jax.Array, index: jax.Array, row_factor=None):
    """`row_operand(a, index)` and the weight GEMM's operand made from it, `token_tiles(values, scales,
    row_factor)`, in one pass: `((values, scales), (tile_values, tile_scales))`. The kernel takes 128 gathered rows
    by 128 columns at a time: it quantises each row's 1x128 tile, then requantises the block's dequantised values
    (times each row's factor) along its 128 rows, which is one 128-token tile of each column (the layout's experts
    start at multiples of 128). For x (factor 1) in the forward and for dy (factor: the rows' routing weights) in the
    backward; `index` as `row_operand`'s, its length a multiple of 128."""
    values, scales = row_operand(a, index)
    factor = jnp.ones(index.shape, jnp.float32) if row_factor is None else row_factor.astype(jnp.float32)
    tile_values, tile_scales = _by_row_tile(lambda v, s, f: token_tiles(v, s, f), values, scales, factor)
    return (values, scales), _assemble_token_tiles(tile_values, tile_scales)


def gate_up_swiglu(a, sfa, b, sfb, expert_offsets):
    """The gate/up rows GEMM with SwiGLU in its epilogue: what `rows_gemm` (bf16), `hidden` and `token_tiles` of
    q(h) write, `(gate_up, (h_values, h_scales), (h_tile_values, h_tile_scales))`, from one pass over its
    accumulator. Per 128-row tile of one expert: the accumulator rounded to bf16 (the saved "moe_gate_up"), SwiGLU of
    that rounded value in float32 rounded to bf16 (h, as `hidden` computes it from the saved projections), h's 1x128
    tiles along I, then q(h)'s 128-row token tiles. Rows past `expert_offsets[E]`: zero projections, zero values with
    scale 1. Its CUDA kernel needs a gate block and its up block in one thread block's columns (b's 128-row blocks
    reordered gate 0, up 0, gate 1, ...: a 256-wide N tile), since SwiGLU pairs column c with column I + c."""

    def epilogue(acc, used):
        gate_up = jnp.where(used, acc, 0).astype(jnp.bfloat16)
        h = fp8.round_to(swiglu(gate_up.astype(jnp.float32)), jnp.bfloat16)
        values, scales = quantize(h, (1, BLOCK))
        return gate_up, values, scales, *token_tiles(values, scales)

    gate_up, values, scales, tile_values, tile_scales = _rows_gemm_tiles(epilogue, a, sfa, b, sfb, expert_offsets)
    rows = a.shape[0]
    return (
        gate_up.reshape(rows, -1),
        (values.reshape(rows, -1), scales.reshape(rows, -1)),
        _assemble_token_tiles(tile_values, tile_scales),
    )


def g_swiglu_grad(a, sfa, b, sfb, expert_offsets, gate_up, row_weights, h_values, h_scales):
    """The backward's g GEMM (g = q(dy) . q(Wd)^T) with SwiGLU' and the routing weight in its epilogue: what
    `rows_gemm` (float32 g), `hidden_grad`, `token_tiles` of q(dz) and `fp8.row_dots(q(h), g)` compute, from one
    pass over its accumulator, without g in memory: `((dz_values, dz_scales), (dz_tile_values, dz_tile_scales),
    d_row_weights)`. Per 128-row tile of one expert, g is the float32 accumulator itself (what `rows_gemm` stores),
    dz = SwiGLU'(gate_up) applied to `row_weights * g` in float32 (`fp8.swiglu_grad`, the saved bf16 projections),
    its 1x128 tiles along 2I (the gate tile c and the up tile c both from g's columns c: a 128-wide N tile of g
    writes both), then q(dz)'s 128-row token tiles; the routing-weight gradient is `fp8.tile_dots(q(h), g)` per
    128-column tile, in the epilogue's order, then the tiles' sums added in column order (`fp8.sum_in_order`: the
    kernel writes the tiles' sums, `[R, I/128]`, and the last step adds them). Rows past `expert_offsets[E]`: zero
    values with scale 1, d weight 0."""

    def epilogue(acc, used, gate_up_t, weights_t, h_values_t, h_scales_t):
        g = jnp.where(used, acc, 0)
        dz = jnp.where(used, fp8.swiglu_grad(gate_up_t.astype(jnp.float32), weights_t[:, None] * g), 0)
        values, scales = quantize(dz, (1, BLOCK))
        dots = fp8.tile_dots(dequantize(h_values_t, h_scales_t, (1, BLOCK)), g)
        return values, scales, *token_tiles(values, scales), dots

    row_weights = row_weights.astype(jnp.float32)
    values, scales, tile_values, tile_scales, dots = _rows_gemm_tiles(
        epilogue, a, sfa, b, sfb, expert_offsets, gate_up, row_weights, h_values, h_scales
    )
    rows = a.shape[0]
    return (
        (values.reshape(rows, -1), scales.reshape(rows, -1)),
        _assemble_token_tiles(tile_values, tile_scales),
        fp8.sum_in_order(dots.reshape(rows, -1)),
    )
