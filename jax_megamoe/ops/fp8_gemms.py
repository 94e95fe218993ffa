"""The "fp8_blockwise" recipe (rule and reference: jax_megamoe/ops/fp8.py) on grouped FP8 GEMMs: the two CUDA
kernels on Hopper's FP8 tensor cores, or on CPU their emulation in float32 (dequantised operands, the same bf16
outputs), so that CI runs every step around the kernels.

CUDA kernels quantise the operands in one pass each, writing the layout each GEMM takes (`fp8_weight_blocks`,
`fp8_row_operand`, `fp8_hidden`, `fp8_hidden_grad`, `fp8_token_tiles`; XLA's fusions on CPU); the GEMMs take e4m3
values with float32 scales:
  rows GEMM    gate_up = q(x) . q(Wgu), out = q(h) . q(Wd), g = q(dy) . q(Wd)^T, dx rows = q(dz) . q(Wgu)^T
  weight GEMM  dWd = qt(q(h))^T . qt(weights * q(dy)), dWgu = qt(q(x))^T . qt(q(dz))
Rows live in a padded expert-sorted order: each expert's rows (stable in (token, k) order) start at a multiple of
128, so that the weight GEMMs' token tiles (128 rows of one expert, counted from its first row) are whole tiles of
the row arrays, and the padding rows are zero. The GEMMs accumulate in float32 and write x's dtype (the
projections, out and the rows of dx), float32 (g, from which d weights and dz follow as in the reference) or the
weights' dtype (their gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_megamoe import _ffi, _targets
from jax_megamoe.ops import fp8
from jax_megamoe.ops.fp8 import BLOCK, dequantize, quantize
from jax_megamoe.ops.layout import moe_layout

_HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------------------------
# The two GEMMs: the CUDA kernels and their CPU emulation.


def _out_dtype(dtype):
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"the FP8 GEMMs write bfloat16 or float32, got {dtype}")
    return jnp.dtype(dtype)


def fp8_rows_gemm(
    a: jax.Array, sfa: jax.Array, b: jax.Array, sfb: jax.Array, expert_offsets: jax.Array, out_dtype=jnp.bfloat16
) -> jax.Array:
    """`d[rows of e] = dequantize(a)[rows of e] @ dequantize(b[e])^T` in `out_dtype` (bfloat16 or float32), on the
    FP8 tensor cores.

    a: `[R, K]` e4m3fn with `sfa [R, K/128]` float32 (`quantize(x, (1, 128))`); b: `[E, N, K]` e4m3fn with
    `sfb [E, N/128, K/128]` (`quantize(w, (1, 128, 128))`: both operands K-major, as sm90 FP8 wgmma takes them);
    rows of expert e are `[expert_offsets[e], expert_offsets[e + 1])`. N and K are multiples of 128. Rows at or
    past `expert_offsets[E]` are not written. CUDA only (`jmm_cuda_fp8_rows_gemm`)."""
    rows, depth = a.shape
    experts, n, _ = b.shape
    if n % BLOCK or depth % BLOCK:
        raise ValueError(f"fp8_rows_gemm needs N and K multiples of {BLOCK}, got N={n}, K={depth}")
    [d] = _ffi.call(
        _targets.FP8_ROWS_GEMM,
        (jax.ShapeDtypeStruct((rows, n), _out_dtype(out_dtype)),),
        a,
        sfa.astype(jnp.float32),
        b,
        sfb.astype(jnp.float32),
        expert_offsets.astype(jnp.int32),
        workspace_args=(experts,),
    )
    return d


def fp8_weight_gemm(
    a: jax.Array,
    sfa: jax.Array,
    b: jax.Array,
    sfb: jax.Array,
    token_offsets: jax.Array,
    num_experts: int,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """`d[e] = dequantize(a)_e @ dequantize(b)_e^T`, `[E, M, N]` in `out_dtype` (bfloat16 or float32), on the FP8
    tensor cores: the weight gradients' GEMM, contracting over each expert's tokens.

    a: `[M, P]`, b: `[N, P]` e4m3fn, token-contiguous (the transposed row operands), expert e's tokens at columns
    `[token_offsets[e], token_offsets[e + 1])`, each boundary a multiple of 128 (every expert's rows padded to a
    whole number of 128-token tiles); sfa `[P/128, M]`, sfb `[P/128, N]` float32: the scales of 1x128 tiles along
    the tokens, counted from each expert's first row (`xla_token_tiles` builds all four). M, N, P multiples of 128.
    Columns past `token_offsets[E]` are not read. Experts without tokens get zeros. CUDA only
    (`jmm_cuda_fp8_weight_gemm`)."""
    m, tokens = a.shape
    n = b.shape[0]
    if m % BLOCK or n % BLOCK or tokens % BLOCK:
        raise ValueError(f"fp8_weight_gemm needs M, N and P multiples of {BLOCK}, got M={m}, N={n}, P={tokens}")
    [d] = _ffi.call(
        _targets.FP8_WEIGHT_GEMM,
        (jax.ShapeDtypeStruct((num_experts, m, n), _out_dtype(out_dtype)),),
        a,
        sfa.astype(jnp.float32),
        b,
        sfb.astype(jnp.float32),
        token_offsets.astype(jnp.int32),
        workspace_args=(num_experts,),
    )
    return d


def _tile_experts(offsets: jax.Array, tiles: int) -> jax.Array:
    """The group of each 128-row (or 128-column) tile given group offsets that are multiples of 128: E past the
    last group's."""
    starts = jnp.arange(tiles, dtype=jnp.int32) * BLOCK
    return (jnp.searchsorted(offsets.astype(jnp.int32), starts, side="right") - 1).astype(jnp.int32)


def emulated_rows_gemm(a, sfa, b, sfb, expert_offsets, out_dtype=jnp.bfloat16):
    """`fp8_rows_gemm` in float32 on the dequantised operands (rows past `expert_offsets[E]` are zero), for the op's
    padded layout (offsets multiples of 128): one 128-row tile at a time, each within one expert's rows, so that no
    temporary grows with the rows times E (XLA:CPU expands a ragged_dot over all groups)."""
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
        return jnp.where(e < experts, out, 0).astype(_out_dtype(out_dtype))

    tiles = rows // BLOCK
    by_tile = (
        a.reshape(tiles, BLOCK, depth),
        sfa.reshape(tiles, BLOCK, depth // BLOCK),
        _tile_experts(expert_offsets, tiles),
    )
    return jax.lax.map(one_tile, by_tile).reshape(rows, n)


def emulated_weight_gemm(a, sfa, b, sfb, token_offsets, num_experts, out_dtype=jnp.bfloat16):
    """`fp8_weight_gemm` in float32 on the dequantised operands: each 128-token tile's product added to its expert's
    sum, tiles in order (so the same tiles give the same sums, however many other columns there are)."""
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
    return sums[:num_experts].astype(_out_dtype(out_dtype))


def fp8_weight_blocks(w: jax.Array, transpose: bool) -> tuple[jax.Array, jax.Array]:
    """`quantize(w, (1, 128, 128))` of `w [E, A, B]` (bf16 or float32, A and B multiples of 128) in one pass, the
    values `[E, A, B]` e4m3fn or, with `transpose`, `[E, B, A]` (scales likewise `[E, B/128, A/128]`). CUDA only
    (`jmm_cuda_fp8_quantize_blocks`)."""
    experts, rows, cols = w.shape
    if rows % BLOCK or cols % BLOCK:
        raise ValueError(f"fp8_weight_blocks needs both matrix sizes multiples of {BLOCK}, got {w.shape}")
    a, b = (cols, rows) if transpose else (rows, cols)
    return _ffi.call(
        _targets.FP8_QUANTIZE_BLOCKS,
        (
            jax.ShapeDtypeStruct((experts, a, b), fp8.FP8_DTYPE),
            jax.ShapeDtypeStruct((experts, a // BLOCK, b // BLOCK), jnp.float32),
        ),
        w,
        transpose=np.int64(transpose),
    )


def xla_weight_blocks(w: jax.Array, transpose: bool) -> tuple[jax.Array, jax.Array]:
    """`fp8_weight_blocks` by XLA: square blocks, so quantising then transposing equals transposing then
    quantising."""
    return quantize(jnp.swapaxes(w, 1, 2) if transpose else w, (1, BLOCK, BLOCK))


def _row_tiles(rows: int, cols: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The results of a CUDA row-tile quantiser: values `[rows, cols]` e4m3fn, scales `[rows, cols / 128]`."""
    return (
        jax.ShapeDtypeStruct((rows, cols), fp8.FP8_DTYPE),
        jax.ShapeDtypeStruct((rows, cols // BLOCK), jnp.float32),
    )


def fp8_row_operand(a: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`xla_row_operand` in one CUDA pass (`jmm_cuda_fp8_quantize_rows`): bf16 `a [T, C]`, C a multiple of 128."""
    rows, cols = index.shape[0], a.shape[1]
    if cols % BLOCK:
        raise ValueError(f"fp8_row_operand needs a row width that is a multiple of {BLOCK}, got {cols}")
    return _ffi.call(
        _targets.FP8_QUANTIZE_ROWS,
        _row_tiles(rows, cols),
        a.astype(jnp.bfloat16),
        index.astype(jnp.int32),
    )


def xla_row_operand(a: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`a [T, C]` quantised in 1x128 tiles per token, then its rows `index` (past T: zero values, scale 1)."""
    return take_rows(*quantize(a, (1, BLOCK)), index)


def take_rows(values: jax.Array, scales: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows `index` of quantised rows (past their end: zero values, scale 1), as `quantised_rows` gives them."""
    take = functools.partial(jnp.take, indices=index, axis=0, mode="fill")
    return take(values, fill_value=0), take(scales, fill_value=1)


def fp8_hidden(gate_up: jax.Array, offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`xla_hidden` in one CUDA pass (`jmm_cuda_fp8_swiglu_rows`): bf16 `gate_up [R, 2I]`, I a multiple of 128."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    return _ffi.call(
        _targets.FP8_SWIGLU_ROWS,
        _row_tiles(rows, inter),
        gate_up,
        offsets.astype(jnp.int32),
    )


def xla_hidden(gate_up: jax.Array, offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q(h): the SwiGLU of the projections rounded to bf16 (x's dtype), the rows past the last expert's zero (the
    rows GEMM does not write them), quantised along I."""
    h = fp8.round_to(fp8._swiglu(gate_up.astype(jnp.float32)), jnp.bfloat16)
    return quantize(_used(h, offsets), (1, BLOCK))


# ---------------------------------------------------------------------------------------------------------------
# The padded row layout and the operands.


def row_capacity(pairs: int, num_experts: int) -> int:
    """Rows of the padded layout: every expert's rows rounded up to a multiple of 128, at most."""
    return fp8._round_up(pairs + (BLOCK - 1) * min(num_experts, pairs))


class RowLayout(NamedTuple):
    """The pairs in expert-sorted order, each expert's first row at a multiple of 128 (saved as "moe_layout")."""

    row_of_pair: jax.Array  # [T*K] int32: the pair's row; the capacity for a dropped pair
    pair_of_row: jax.Array  # [capacity] int32: the row's pair; T*K for padding rows
    offsets: jax.Array  # [E + 1] int32: expert e's rows [offsets[e], offsets[e+1]), multiples of 128


def row_layout(experts: jax.Array, num_experts: int, implementation: str) -> RowLayout:
    """`experts` int32 with the dropped ids at -1 (`drop_invalid_ids`)."""
    pairs = experts.size
    capacity = row_capacity(pairs, num_experts)
    layout = moe_layout(experts, num_experts, implementation)
    counts = jnp.diff(layout.expert_offsets)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(-(-counts // BLOCK) * BLOCK).astype(jnp.int32)])
    shift = offsets[:-1] - layout.expert_offsets[:-1]
    ids = experts.reshape(-1)
    row_of_pair = jnp.where(layout.row_of_pair >= 0, layout.row_of_pair + shift[jnp.maximum(ids, 0)], capacity)
    pair_of_row = (
        jnp.full(capacity, pairs, jnp.int32).at[row_of_pair].set(jnp.arange(pairs, dtype=jnp.int32), mode="drop")
    )
    return RowLayout(row_of_pair.astype(jnp.int32), pair_of_row, offsets)


def _used(rows: jax.Array, offsets: jax.Array) -> jax.Array:
    """`rows` with the rows past the last expert's (which the rows GEMM does not write) set to zero."""
    return jnp.where((jnp.arange(rows.shape[0]) < offsets[-1])[:, None], rows, 0)


def xla_token_tiles(values: jax.Array, scales: jax.Array, row_factor=None) -> tuple[jax.Array, jax.Array]:
    """A row operand (`values [R, C]` e4m3fn, `scales [R, C/128]`, padded layout) as the weight GEMM's operand:
    `row_factor [R] * dequantize(values, scales)` (factor 1 when None) requantised in 1x128 tiles along the rows,
    values `[C, R]`, scales `[R/128, C]`."""
    rows = dequantize(values, scales, (1, BLOCK))
    if row_factor is not None:
        rows = row_factor[:, None] * rows
    tiles = rows.reshape(rows.shape[0] // BLOCK, BLOCK, rows.shape[1])
    out_scales = fp8._scale(jnp.max(jnp.abs(tiles), axis=1))
    out = fp8._to_fp8(tiles, out_scales[:, None, :]).reshape(rows.shape)
    return out.T, out_scales


def fp8_token_tiles(values: jax.Array, scales: jax.Array, row_factor=None) -> tuple[jax.Array, jax.Array]:
    """`xla_token_tiles` in one CUDA pass (`jmm_cuda_fp8_token_tiles`)."""
    rows, cols = values.shape
    if rows % BLOCK or cols % BLOCK:
        raise ValueError(f"fp8_token_tiles needs both sizes multiples of {BLOCK}, got {values.shape}")
    factor = jnp.ones((rows,), jnp.float32) if row_factor is None else row_factor.astype(jnp.float32)
    return _ffi.call(
        _targets.FP8_TOKEN_TILES,
        (
            jax.ShapeDtypeStruct((cols, rows), fp8.FP8_DTYPE),
            jax.ShapeDtypeStruct((rows // BLOCK, cols), jnp.float32),
        ),
        values,
        scales,
        factor,
    )


def _pair_sum(rows: jax.Array, row_of_pair: jax.Array, top_k: int, weights=None) -> jax.Array:
    """`[T, C]` float32: each token's rows summed over its k pairs (times `weights [T, K]`); a dropped pair adds 0."""
    picked = jnp.take(rows, row_of_pair, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    if weights is not None:
        picked = picked * weights.reshape(-1, 1).astype(jnp.float32)
    return picked.reshape(-1, top_k, rows.shape[1]).sum(axis=1)


def xla_hidden_grad(gate_up, g, row_weights, offsets) -> tuple[jax.Array, jax.Array]:
    """q(dz): SwiGLU's derivative at the projections applied to `row_weights * g` in float32, the rows past the last
    expert's zero, quantised along 2I."""
    dz = fp8._swiglu_bwd(gate_up.astype(jnp.float32), row_weights[:, None] * g)
    return quantize(_used(dz, offsets), (1, BLOCK))


def fp8_hidden_grad(gate_up, g, row_weights, offsets) -> tuple[jax.Array, jax.Array]:
    """`xla_hidden_grad` in one CUDA pass (`jmm_cuda_fp8_swiglu_grad_rows`): bf16 `gate_up [R, 2I]`, float32
    `g [R, I]` and `row_weights [R]`, I a multiple of 128."""
    rows, two_inter = gate_up.shape
    return _ffi.call(
        _targets.FP8_SWIGLU_GRAD_ROWS,
        _row_tiles(rows, two_inter),
        gate_up,
        g.astype(jnp.float32),
        row_weights.astype(jnp.float32),
        offsets.astype(jnp.int32),
    )


class _Kernels(NamedTuple):
    rows: Callable  # fp8_rows_gemm's contract
    weight: Callable  # fp8_weight_gemm's
    blocks: Callable  # fp8_weight_blocks'
    row_operand: Callable  # xla_row_operand's
    hidden: Callable  # xla_hidden's
    token_tiles: Callable  # xla_token_tiles'
    hidden_grad: Callable  # xla_hidden_grad's


KERNELS = {
    "cuda": _Kernels(
        fp8_rows_gemm,
        fp8_weight_gemm,
        fp8_weight_blocks,
        fp8_row_operand,
        fp8_hidden,
        fp8_token_tiles,
        fp8_hidden_grad,
    ),
    "cpu": _Kernels(
        emulated_rows_gemm,
        emulated_weight_gemm,
        xla_weight_blocks,
        xla_row_operand,
        xla_hidden,
        xla_token_tiles,
        xla_hidden_grad,
    ),
}


# ---------------------------------------------------------------------------------------------------------------
# The op.


class _Sizes(NamedTuple):
    hidden: int
    inter: int
    experts: int
    top_k: int
    hidden_p: int
    inter_p: int


def _sizes(hidden, weights, w_gate_up) -> _Sizes:
    top_k = weights.shape[1]
    experts, _, two_inter = w_gate_up.shape
    inter = two_inter // 2
    return _Sizes(hidden, inter, experts, top_k, fp8._round_up(hidden), fp8._round_up(inter))


def _padded_weights(w_gate_up, w_down, s: _Sizes):
    if (s.hidden_p, s.inter_p) == (s.hidden, s.inter):
        return w_gate_up, w_down
    gate_up = fp8._pad_gate_up(w_gate_up, s.hidden_p, s.inter_p)
    down = jnp.pad(w_down, ((0, 0), (0, s.inter_p - s.inter), (0, s.hidden_p - s.hidden)))
    return gate_up, down


def _pad_hidden(a, s: _Sizes):
    return jnp.pad(a, ((0, 0), (0, s.hidden_p - s.hidden)))


def quantised_rows(x: jax.Array, index: jax.Array, implementation: str) -> tuple[jax.Array, jax.Array]:
    """q(x)'s rows `index` (past T: zero values, scale 1): bf16 `x [T, H]` zero-padded to a multiple of 128 and
    quantised in 1x128 tiles, values `[len(index), Hp]` e4m3fn and scales `[len(index), Hp/128]`, in one pass."""
    padded = jnp.pad(x, ((0, 0), (0, fp8._round_up(x.shape[1]) - x.shape[1])))
    return KERNELS[implementation].row_operand(padded, index)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _moe_ffn_fp8(x, weights, experts, w_gate_up, w_down, implementation):
    return _moe_ffn_fp8_fwd(x, weights, experts, w_gate_up, w_down, implementation)[0]


def _moe_ffn_fp8_fwd(x, weights, experts, w_gate_up, w_down, implementation):
    x_rows = functools.partial(quantised_rows, x, implementation=implementation)
    return forward(x_rows, x.shape[1], x.dtype, weights, experts, w_gate_up, w_down, implementation)


def forward(x_rows: Callable, hidden: int, x_dtype, weights, experts, w_gate_up, w_down, implementation: str):
    """The op's forward from q(x): `(y [T, H] in x_dtype, residuals for backward)`, where `x_rows(index)` returns
    q(x)'s rows `index` (`quantised_rows` of x, or `take_rows` of rows that arrived quantised), T = weights' rows."""
    kernels, s = KERNELS[implementation], _sizes(hidden, weights, w_gate_up)
    layout = RowLayout(*(checkpoint_name(a, fp8.LAYOUT_NAME) for a in row_layout(experts, s.experts, implementation)))
    wgu, wd = _padded_weights(w_gate_up, w_down, s)
    xv, xs = x_rows(layout.pair_of_row // s.top_k)
    gate_up = kernels.rows(xv, xs, *kernels.blocks(wgu, transpose=True), layout.offsets)
    hidden_q = kernels.hidden(gate_up, layout.offsets)
    out = kernels.rows(*hidden_q, *kernels.blocks(wd, transpose=True), layout.offsets)
    y = _pair_sum(out, layout.row_of_pair, s.top_k, weights)[:, : s.hidden].astype(x_dtype)
    # q(h) and the token tiles of q(x) are saved rather than recomputed: the backward then skips a quantising pass
    # over x's rows and one over the projections (under a remat policy that saves only the named residuals below,
    # the backward recomputes them from x and the projections, the same values).
    x_tiles = kernels.token_tiles(xv, xs)
    weights, layout, gate_up, hidden_q, x_tiles = _ffi.residuals((weights, layout, gate_up, hidden_q, x_tiles))
    gate_up = checkpoint_name(gate_up, fp8.GATE_UP_NAME)
    return y, (weights, experts, w_gate_up, w_down, gate_up, layout, hidden_q, x_tiles)


def backward(implementation: str, residuals, dy):
    """`forward`'s VJP: `(dx, d weights, float0 for the experts, d w_gate_up, d w_down)` from y's cotangent."""
    weights, experts, w_gate_up, w_down, gate_up, layout, (hv, hs), x_tiles = residuals
    x_dtype = dy.dtype  # y's, which is x's
    kernels, s = KERNELS[implementation], _sizes(dy.shape[1], weights, w_gate_up)
    wgu, wd = _padded_weights(w_gate_up, w_down, s)
    token_of_row = layout.pair_of_row // s.top_k
    dyv, dys = kernels.row_operand(_pad_hidden(dy, s), token_of_row)
    g = kernels.rows(dyv, dys, *kernels.blocks(wd, transpose=False), layout.offsets, jnp.float32)
    h = dequantize(hv, hs, (1, BLOCK))
    row_weights = jnp.take(weights.reshape(-1).astype(jnp.float32), layout.pair_of_row, mode="fill", fill_value=0)
    d_row_weights = jnp.sum(h * g, axis=-1)
    dzv, dzs = kernels.hidden_grad(gate_up, g, row_weights, layout.offsets)
    dx_rows = kernels.rows(dzv, dzs, *kernels.blocks(wgu, transpose=False), layout.offsets)
    dx = _pair_sum(dx_rows, layout.row_of_pair, s.top_k)[:, : s.hidden]
    d_weights = jnp.take(d_row_weights, layout.row_of_pair, mode="fill", fill_value=0).reshape(weights.shape)
    d_w_down = kernels.weight(
        *kernels.token_tiles(hv, hs),
        *kernels.token_tiles(dyv, dys, row_weights),
        layout.offsets,
        s.experts,
        w_down.dtype,
    )
    d_w_gate_up = kernels.weight(
        *x_tiles,
        *kernels.token_tiles(dzv, dzs),
        layout.offsets,
        s.experts,
        w_gate_up.dtype,
    )
    return (
        dx.astype(x_dtype),
        d_weights.astype(weights.dtype),
        np.zeros(experts.shape, jax.dtypes.float0),
        fp8._unpad_gate_up(d_w_gate_up, s.hidden, s.inter).astype(w_gate_up.dtype),
        d_w_down[:, : s.inter, : s.hidden].astype(w_down.dtype),
    )


_moe_ffn_fp8.defvjp(_moe_ffn_fp8_fwd, backward)


@functools.partial(jax.jit, static_argnums=5, inline=True)
def moe_ffn_fp8(x, weights, experts, w_gate_up, w_down, implementation: str):
    """`moe_ffn` with recipe="fp8_blockwise" on `implementation`'s GEMMs ("cuda" or "cpu"), arguments already
    checked (`fp8.check_fp8_args`), experts int32 with the dropped ids at -1."""
    return _moe_ffn_fp8(x, weights, experts, w_gate_up, w_down, implementation)
