"""The "fp8_blockwise" recipe (rule and reference: jax_megamoe/ops/fp8.py) on grouped FP8 GEMMs, under a custom
VJP: the CUDA kernels on Hopper's FP8 tensor cores (`fp8_cuda`), or on CPU their emulation (`fp8_emulation`).

Each GEMM operand is written by one quantising pass in the layout its GEMM takes (`weight_blocks`, `row_operand`,
`hidden`, `hidden_grad`, `token_tiles`); the GEMMs take e4m3 values with float32 scales:
  rows GEMM    gate_up = q(x) . q(Wgu), out = q(h) . q(Wd), g = q(dy) . q(Wd)^T, dx rows = q(dz) . q(Wgu)^T
  weight GEMM  dWd = qt(q(h))^T . qt(weights * q(dy)), dWgu = qt(q(x))^T . qt(q(dz))
Rows live in a padded expert-sorted order (`layout.padded_layout`): each expert's rows (stable in (token, k) order)
start at a multiple of 128, so that the weight GEMMs' token tiles (128 rows of one expert, counted from its first
row) are whole tiles of the row arrays, and the padding rows are zero. The GEMMs accumulate in float32 and write
x's dtype (the projections, out and the rows of dx), float32 (g, from which d weights and dz follow as in the
reference) or the weights' dtype (their gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_megamoe import _ffi
from jax_megamoe.ops import fp8, fp8_cuda, fp8_emulation
from jax_megamoe.ops.fp8 import BLOCK, dequantize
from jax_megamoe.ops.layout import Layout, padded_layout


class _Kernels(NamedTuple):
    """One implementation of the kernels' contracts (`fp8_cuda`'s functions of these names), and whether the
    backward takes its weight blocks from the forward's (`reuse_weight_blocks`: the forward's blocks saved and
    transposed, `fp8.transpose_blocks`, exact) or quantises the weights again in its own layout."""

    rows_gemm: Callable
    weight_gemm: Callable
    weight_blocks: Callable
    row_operand: Callable
    hidden: Callable
    token_tiles: Callable
    hidden_grad: Callable
    reuse_weight_blocks: bool


# The CUDA path quantises the weights again in the backward until saving the forward's blocks (their memory against
# one quantising pass per weight) has been measured on a GPU; the emulation reuses them (the same values either way).
KERNELS = {
    implementation: _Kernels(
        module.rows_gemm,
        module.weight_gemm,
        module.weight_blocks,
        module.row_operand,
        module.hidden,
        module.token_tiles,
        module.hidden_grad,
        reuse,
    )
    for implementation, module, reuse in (("cuda", fp8_cuda, False), ("cpu", fp8_emulation, True))
}


class _Sizes(NamedTuple):
    hidden: int
    inter: int
    experts: int
    top_k: int


def _sizes(hidden, weights, w_gate_up) -> _Sizes:
    experts, _, two_inter = w_gate_up.shape
    return _Sizes(hidden, two_inter // 2, experts, weights.shape[1])


def _pair_sum(rows: jax.Array, row_of_pair: jax.Array, top_k: int, weights=None) -> jax.Array:
    """`[T, C]` float32: each token's rows summed over its k pairs (times `weights [T, K]`); a dropped pair adds 0."""
    picked = jnp.take(rows, row_of_pair, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    if weights is not None:
        picked = picked * weights.reshape(-1, 1).astype(jnp.float32)
    return picked.reshape(-1, top_k, rows.shape[1]).sum(axis=1)


def quantised_rows(x: jax.Array, index: jax.Array, implementation: str) -> tuple[jax.Array, jax.Array]:
    """q(x)'s rows `index` (past T: zero values, scale 1): bf16 `x [T, H]` zero-padded to a multiple of 128 and
    quantised in 1x128 tiles, values `[len(index), Hp]` e4m3fn and scales `[len(index), Hp/128]`, in one pass."""
    return KERNELS[implementation].row_operand(fp8.pad_hidden(x), index)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _moe_ffn_fp8(x, weights, experts, w_gate_up, w_down, implementation):
    return _moe_ffn_fp8_fwd(x, weights, experts, w_gate_up, w_down, implementation)[0]


def _moe_ffn_fp8_fwd(x, weights, experts, w_gate_up, w_down, implementation):
    x_rows = functools.partial(quantised_rows, x, implementation=implementation)
    return forward(x_rows, x.shape[1], x.dtype, weights, experts, w_gate_up, w_down, implementation)


def forward(x_rows: Callable, hidden: int, x_dtype, weights, experts, w_gate_up, w_down, implementation: str):
    """The op's forward from q(x): `(y [T, H] in x_dtype, residuals for backward)`, where `x_rows(index)` returns
    q(x)'s rows `index` (`quantised_rows` of x, or `fp8.take_rows` of rows that arrived quantised), T = weights'
    rows."""
    kernels, s = KERNELS[implementation], _sizes(hidden, weights, w_gate_up)
    layout = padded_layout(experts, s.experts, implementation, BLOCK)
    layout = Layout(*(checkpoint_name(a, fp8.LAYOUT_NAME) for a in layout))
    wgu, wd = fp8.pad_weights(w_gate_up, w_down)
    xv, xs = x_rows(layout.pair_of_row // s.top_k)
    wgu_blocks, wd_blocks = kernels.weight_blocks(wgu, transpose=True), kernels.weight_blocks(wd, transpose=True)
    gate_up = kernels.rows_gemm(xv, xs, *wgu_blocks, layout.expert_offsets)
    hidden_q = kernels.hidden(gate_up, layout.expert_offsets)
    out = kernels.rows_gemm(*hidden_q, *wd_blocks, layout.expert_offsets)
    y = _pair_sum(out, layout.row_of_pair, s.top_k, weights)[:, : s.hidden].astype(x_dtype)
    # q(h) and the token tiles of q(x) are saved rather than recomputed: the backward then skips a quantising pass
    # over x's rows and one over the projections (under a remat policy that saves only the named residuals below,
    # the backward recomputes them from x and the projections, the same values).
    x_tiles = kernels.token_tiles(xv, xs)
    # The backward's weight blocks are the forward's transposed (exact for square blocks) where they are saved.
    blocks = (wgu_blocks, wd_blocks) if kernels.reuse_weight_blocks else None
    weights, layout, gate_up, hidden_q, x_tiles, blocks = _ffi.residuals(
        (weights, layout, gate_up, hidden_q, x_tiles, blocks)
    )
    gate_up = checkpoint_name(gate_up, fp8.GATE_UP_NAME)
    return y, (weights, experts, w_gate_up, w_down, gate_up, layout, hidden_q, x_tiles, blocks)


def backward(implementation: str, residuals, dy):
    """`forward`'s VJP: `(dx, d weights, float0 for the experts, d w_gate_up, d w_down)` from y's cotangent."""
    weights, experts, w_gate_up, w_down, gate_up, layout, (hv, hs), x_tiles, blocks = residuals
    x_dtype = dy.dtype  # y's, which is x's
    kernels, s = KERNELS[implementation], _sizes(dy.shape[1], weights, w_gate_up)
    if blocks is None:
        wgu, wd = fp8.pad_weights(w_gate_up, w_down)
        wgu_blocks, wd_blocks = kernels.weight_blocks(wgu, transpose=False), kernels.weight_blocks(wd, transpose=False)
    else:
        wgu_blocks, wd_blocks = (fp8.transpose_blocks(*b) for b in blocks)
    token_of_row = layout.pair_of_row // s.top_k
    dyv, dys = kernels.row_operand(fp8.pad_hidden(dy), token_of_row)
    g = kernels.rows_gemm(dyv, dys, *wd_blocks, layout.expert_offsets, jnp.float32)
    h = dequantize(hv, hs, (1, BLOCK))
    row_weights = jnp.take(weights.reshape(-1).astype(jnp.float32), layout.pair_of_row, mode="fill", fill_value=0)
    d_row_weights = fp8.row_dots(h, g)  # in the order the g GEMM's epilogue will compute it
    dzv, dzs = kernels.hidden_grad(gate_up, g, row_weights, layout.expert_offsets)
    dx_rows = kernels.rows_gemm(dzv, dzs, *wgu_blocks, layout.expert_offsets)
    dx = _pair_sum(dx_rows, layout.row_of_pair, s.top_k)[:, : s.hidden]
    d_weights = jnp.take(d_row_weights, layout.row_of_pair, mode="fill", fill_value=0).reshape(weights.shape)
    d_w_down = kernels.weight_gemm(
        *kernels.token_tiles(hv, hs),
        *kernels.token_tiles(dyv, dys, row_weights),
        layout.expert_offsets,
        s.experts,
        w_down.dtype,
    )
    d_w_gate_up = kernels.weight_gemm(
        *x_tiles,
        *kernels.token_tiles(dzv, dzs),
        layout.expert_offsets,
        s.experts,
        w_gate_up.dtype,
    )
    return (
        dx.astype(x_dtype),
        d_weights.astype(weights.dtype),
        np.zeros(experts.shape, jax.dtypes.float0),
        fp8.unpad_gate_up(d_w_gate_up, s.hidden, s.inter).astype(w_gate_up.dtype),
        d_w_down[:, : s.inter, : s.hidden].astype(w_down.dtype),
    )


_moe_ffn_fp8.defvjp(_moe_ffn_fp8_fwd, backward)


@functools.partial(jax.jit, static_argnums=5, inline=True)
def moe_ffn_fp8(x, weights, experts, w_gate_up, w_down, implementation: str):
    """`moe_ffn` with recipe="fp8_blockwise" on `implementation`'s GEMMs ("cuda" or "cpu"), arguments already
    checked (`fp8.check_fp8_args`), experts int32 with the dropped ids at -1."""
    return _moe_ffn_fp8(x, weights, experts, w_gate_up, w_down, implementation)
