"""The "fp8_blockwise" recipe's CUDA kernels (`_targets.FP8_*`): its two grouped GEMMs on Hopper's FP8 tensor cores
and the quantising passes that each write one GEMM operand in the layout that GEMM takes. `fp8_emulation` holds
the same contracts in XLA; `fp8_gemms` composes either into the op.

  rows GEMM    d[rows of e] = q(a)[rows of e] . q(b_e)^T     gate_up, out, g, the rows of dx
  weight GEMM  d_e = qt(a)_e . qt(b)_e^T over e's tokens     dWd, dWgu
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_megamoe import _ffi, _targets
from jax_megamoe.ops.fp8 import BLOCK, FP8_DTYPE, gemm_out_dtype


def rows_gemm(
    a: jax.Array, sfa: jax.Array, b: jax.Array, sfb: jax.Array, expert_offsets: jax.Array, out_dtype=jnp.bfloat16
) -> jax.Array:
    """`d[rows of e] = dequantize(a)[rows of e] @ dequantize(b[e])^T` in `out_dtype` (bfloat16 or float32), on the
    FP8 tensor cores (`jmm_cuda_fp8_rows_gemm`).

    a: `[R, K]` e4m3fn with `sfa [R, K/128]` float32 (`quantize(x, (1, 128))`); b: `[E, N, K]` e4m3fn with
    `sfb [E, N/128, K/128]` (`quantize(w, (1, 128, 128))`: both operands K-major, as sm90 FP8 wgmma takes them);
    rows of expert e are `[expert_offsets[e], expert_offsets[e + 1])`. N and K are multiples of 128. Rows at or
    past `expert_offsets[E]` are not written."""
    rows, depth = a.shape
    experts, n, _ = b.shape
    if n % BLOCK or depth % BLOCK:
        raise ValueError(f"fp8_cuda.rows_gemm needs N and K multiples of {BLOCK}, got N={n}, K={depth}")
    [d] = _ffi.call(
        _targets.FP8_ROWS_GEMM,
        (jax.ShapeDtypeStruct((rows, n), gemm_out_dtype(out_dtype)),),
        a,
        sfa.astype(jnp.float32),
        b,
        sfb.astype(jnp.float32),
        expert_offsets.astype(jnp.int32),
        workspace_args=(experts,),
    )
    return d


def weight_gemm(
    a: jax.Array,
    sfa: jax.Array,
    b: jax.Array,
    sfb: jax.Array,
    token_offsets: jax.Array,
    num_experts: int,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """`d[e] = dequantize(a)_e @ dequantize(b)_e^T`, `[E, M, N]` in `out_dtype` (bfloat16 or float32), on the FP8
    tensor cores (`jmm_cuda_fp8_weight_gemm`): the weight gradients' GEMM, contracting over each expert's tokens.

    a: `[M, P]`, b: `[N, P]` e4m3fn, token-contiguous (the transposed row operands), expert e's tokens at columns
    `[token_offsets[e], token_offsets[e + 1])`, each boundary a multiple of 128 (every expert's rows padded to a
    whole number of 128-token tiles); sfa `[P/128, M]`, sfb `[P/128, N]` float32: the scales of 1x128 tiles along
    the tokens, counted from each expert's first row (`token_tiles` builds all four). M, N, P multiples of 128.
    Columns past `token_offsets[E]` are not read. Experts without tokens get zeros."""
    m, tokens = a.shape
    n = b.shape[0]
    if m % BLOCK or n % BLOCK or tokens % BLOCK:
        raise ValueError(f"fp8_cuda.weight_gemm needs M, N and P multiples of {BLOCK}, got M={m}, N={n}, P={tokens}")
    [d] = _ffi.call(
        _targets.FP8_WEIGHT_GEMM,
        (jax.ShapeDtypeStruct((num_experts, m, n), gemm_out_dtype(out_dtype)),),
        a,
        sfa.astype(jnp.float32),
        b,
        sfb.astype(jnp.float32),
        token_offsets.astype(jnp.int32),
        workspace_args=(num_experts,),
    )
    return d


def weight_blocks(w: jax.Array, transpose: bool) -> tuple[jax.Array, jax.Array]:
    """`quantize(w, (1, 128, 128))` of `w [E, A, B]` (bf16 or float32, A and B multiples of 128) in one pass
    (`jmm_cuda_fp8_quantize_blocks`), the values `[E, A, B]` e4m3fn or, with `transpose`, `[E, B, A]` (scales
    likewise `[E, B/128, A/128]`)."""
    experts, rows, cols = w.shape
    if rows % BLOCK or cols % BLOCK:
        raise ValueError(f"fp8_cuda.weight_blocks needs both matrix sizes multiples of {BLOCK}, got {w.shape}")
    a, b = (cols, rows) if transpose else (rows, cols)
    return _ffi.call(
        _targets.FP8_QUANTIZE_BLOCKS,
        (
            jax.ShapeDtypeStruct((experts, a, b), FP8_DTYPE),
            jax.ShapeDtypeStruct((experts, a // BLOCK, b // BLOCK), jnp.float32),
        ),
        w,
        transpose=np.int64(transpose),
    )


def _row_tiles(rows: int, cols: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The results of a row-tile quantiser: values `[rows, cols]` e4m3fn, scales `[rows, cols / 128]`."""
    return (
        jax.ShapeDtypeStruct((rows, cols), FP8_DTYPE),
        jax.ShapeDtypeStruct((rows, cols // BLOCK), jnp.float32),
    )


def row_operand(a: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`a [T, C]` quantised in 1x128 tiles per token, then its rows `index` (past T: zero values, scale 1), in one
    pass (`jmm_cuda_fp8_quantize_rows`): bf16 `a`, C a multiple of 128."""
    rows, cols = index.shape[0], a.shape[1]
    if cols % BLOCK:
        raise ValueError(f"fp8_cuda.row_operand needs a row width that is a multiple of {BLOCK}, got {cols}")
    return _ffi.call(
        _targets.FP8_QUANTIZE_ROWS,
        _row_tiles(rows, cols),
        a.astype(jnp.bfloat16),
        index.astype(jnp.int32),
    )


def hidden(gate_up: jax.Array, offsets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q(h): the SwiGLU of bf16 `gate_up [R, 2I]` rounded to bf16, the rows past `offsets[-1]` zero, quantised
    along I, in one pass (`jmm_cuda_fp8_swiglu_rows`); I a multiple of 128."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    return _ffi.call(
        _targets.FP8_SWIGLU_ROWS,
        _row_tiles(rows, inter),
        gate_up,
        offsets.astype(jnp.int32),
    )


def token_tiles(values: jax.Array, scales: jax.Array, row_factor=None) -> tuple[jax.Array, jax.Array]:
    """A row operand (`values [R, C]` e4m3fn, `scales [R, C/128]`, R and C multiples of 128) as the weight GEMM's
    operand: `row_factor [R] * dequantize(values, scales)` (factor 1 when None) requantised in 1x128 tiles along the
    rows, values `[C, R]`, scales `[R/128, C]`, in one pass (`jmm_cuda_fp8_token_tiles`)."""
    rows, cols = values.shape
    if rows % BLOCK or cols % BLOCK:
        raise ValueError(f"fp8_cuda.token_tiles needs both sizes multiples of {BLOCK}, got {values.shape}")
    factor = jnp.ones((rows,), jnp.float32) if row_factor is None else row_factor.astype(jnp.float32)
    return _ffi.call(
        _targets.FP8_TOKEN_TILES,
        (
            jax.ShapeDtypeStruct((cols, rows), FP8_DTYPE),
            jax.ShapeDtypeStruct((rows // BLOCK, cols), jnp.float32),
        ),
        values,
        scales,
        factor,
    )


def hidden_grad(gate_up, g, row_weights, offsets) -> tuple[jax.Array, jax.Array]:
    """q(dz): SwiGLU's derivative at bf16 `gate_up [R, 2I]` applied to `row_weights [R] * g [R, I]` in float32,
    the rows past `offsets[-1]` zero, quantised along 2I, in one pass (`jmm_cuda_fp8_swiglu_grad_rows`); I a
    multiple of 128."""
    rows, two_inter = gate_up.shape
    return _ffi.call(
        _targets.FP8_SWIGLU_GRAD_ROWS,
        _row_tiles(rows, two_inter),
        gate_up,
        g.astype(jnp.float32),
        row_weights.astype(jnp.float32),
        offsets.astype(jnp.int32),
    )
