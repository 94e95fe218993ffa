"""The "fp8_blockwise" recipe of `moe_ffn`: every expert GEMM takes e4m3 operands with float32 blockwise scales.

This module holds the recipe's rule (the quantiser), the helpers that the kernels' modules share (`fp8_gemms`, the
op on the grouped FP8 GEMMs; `fp8_cuda`, its CUDA kernels; `fp8_emulation`, their XLA emulation), the recipe's
argument checks, and its quantisation-exact reference (pure JAX, a custom VJP): the reference quantises each GEMM
operand by the rule below, dequantises it to float32 and runs the GEMM in float32. That is what an FP8 tensor-core
GEMM with blockwise scales computes (fp8 x fp8 products are exact in float32, the scales multiply the float32
partial sums), up to the float32 summation order, so the kernels are tested against it.

The rule (docs/fp8.md):
  * values are `jnp.float8_e4m3fn`, scales float32; per tile or block `scale = amax / 448` (an all-zero tile gets
    scale 1), `values = round_to_nearest_even(clip(a / scale, -448, 448))`; the clip comes before the cast,
    since a quotient a hair over 448 would otherwise become NaN (e4m3fn has no infinity).
  * activations and gradients: 1x128 tiles along the contraction dimension of the GEMM that consumes them;
    weights: 128x128 blocks. H and I are zero-padded to multiples of 128 inside the op (gate and up padded
    separately, so no block straddles them); zeros change no amax, so padding changes no value.
  * forward: gate_up = q(x) . q(Wgu) (float32, stored in x's dtype: the saved "moe_gate_up");
    h = SwiGLU(gate_up) in x's dtype; out = q(h) . q(Wd); y = sum_k weights * out, in x's dtype.
  * backward: g = q(dy) . q(Wd)^T; d weights = <q(h), g> per pair; dh = weights * g; dz = SwiGLU'(dh) in
    float32; dx = sum_k q(dz) . q(Wgu)^T. The weight gradients take the transposed operands quantised along
    their contraction (token) dimension, requantised from the fp8 values the row GEMMs used:
    dWd = qt(q(h))^T . qt(weights * q(dy)), dWgu = qt(q(x))^T . qt(q(dz)). A token tile holds 128 consecutive
    rows of one expert in the expert-sorted order (stable in (token, k) order), counted from the expert's first
    row: expert parallelism delivers each expert's rows in that same order, so it computes the same values.
Outputs are in x's dtype, weight gradients in the weights' dtype (master weights may be float32).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_megamoe.ops.layout import Layout, moe_layout
from jax_megamoe.ops.validation import check_float, check_moe_args, check_rank
from jax_megamoe.reference import swiglu

RECIPES = ("fp8_blockwise",)
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
BLOCK = 128  # tile length (activations, gradients) and block side (weights)

# The saved residuals keep moe_ffn's checkpoint names (see jax_megamoe.ops.moe).
LAYOUT_NAME = "moe_layout"
GATE_UP_NAME = "moe_gate_up"


def check_recipe(recipe) -> None:
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"recipe must be None or one of {RECIPES}, got {recipe!r}")


def round_up(n: int) -> int:
    """`n` rounded up to a multiple of `BLOCK`."""
    return -(-n // BLOCK) * BLOCK


# ---------------------------------------------------------------------------------------------------------------
# The quantiser.


def _div(a: jax.Array, b) -> jax.Array:
    """The correctly rounded float32 `a / b`. XLA:CPU turns a division by a divisor that is invariant along the
    loop (a constant, or a scale broadcast over a tile) into a multiplication by its reciprocal, one ulp off in
    about half the cases; a divisor computed per element (`b + 0 * a`) keeps a true division."""
    return a / (b + 0 * a)


def tile_scale(amax: jax.Array) -> jax.Array:
    """The float32 scale of a tile of largest magnitude `amax`: `amax / 448`, 1 for an all-zero tile."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, _div(amax, jnp.float32(FP8_MAX)), 1.0).astype(jnp.float32)


def to_fp8(a: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 `a` over its tiles' `scale` (broadcast), saturated to +-448 and rounded to e4m3fn."""
    # XLA's f32 -> f8e4m3fn conversion rounds to nearest even. The barrier keeps the rounding: with excess
    # precision allowed (its default), XLA's GPU compiler removes a conversion chain f32 -> f8 -> f32, so a value
    # widened again right away would reach the GEMM unrounded.
    return jax.lax.optimization_barrier(jnp.clip(_div(a, scale), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE))


def round_to(a: jax.Array, dtype) -> jax.Array:
    """float32 `a` stored in `dtype` (x's): a reduce_precision first, which XLA keeps, where it may remove the cast
    pair f32 -> bf16 -> f32 on GPUs (as for `to_fp8`), so the stored value is the rounded one everywhere."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(a, exponent_bits=info.nexp, mantissa_bits=info.nmant).astype(dtype)


def quantize(a: jax.Array, block: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """`(values, scales)` of `a` in tiles of shape `block` (one entry per axis of `a`; each of `a`'s sizes a
    multiple of it): values e4m3fn of `a`'s shape, scales float32 of shape `a.shape // block`."""
    a = a.astype(jnp.float32)
    split = [s for n, b in zip(a.shape, block, strict=True) for s in (n // b, b)]
    tiles = a.reshape(split)
    inner = tuple(range(1, 2 * a.ndim, 2))
    scales = tile_scale(jnp.max(jnp.abs(tiles), axis=inner))
    values = to_fp8(tiles, jnp.expand_dims(scales, inner))
    return values.reshape(a.shape), scales


def dequantize(values: jax.Array, scales: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """float32 `values * scale` of each tile (the inverse layout of `quantize`)."""
    split = [s for n, b in zip(values.shape, block, strict=True) for s in (n // b, b)]
    inner = tuple(range(1, 2 * values.ndim, 2))
    tiles = values.astype(jnp.float32).reshape(split) * jnp.expand_dims(scales, inner)
    return tiles.reshape(values.shape)


def fake_quantize(a: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """`dequantize(*quantize(a, block), block)`: the float32 values an FP8 GEMM sees."""
    return dequantize(*quantize(a, block), block)


def transpose_blocks(values: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`quantize(w, (1, 128, 128))` of `w [E, A, B]` turned into that of `swapaxes(w, 1, 2)`, exactly: a square
    block holds the same elements either way, so its amax, its scale and each value's quotient are the same, and the
    transposed weight's blocks are these blocks transposed, bit for bit (no requantisation)."""
    return jnp.swapaxes(values, 1, 2), jnp.swapaxes(scales, 1, 2)


def take_rows(values: jax.Array, scales: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows `index` of quantised rows `(values [R, C], scales [R, C/128])`; past R: zero values, scale 1."""
    take = functools.partial(jnp.take, indices=index, axis=0, mode="fill")
    return take(values, fill_value=0), take(scales, fill_value=1)


# ---------------------------------------------------------------------------------------------------------------
# Helpers around the GEMMs, shared by the reference and the kernels' modules.


def gemm_out_dtype(dtype) -> jnp.dtype:
    """`dtype` if the FP8 GEMMs can write it (bfloat16, float32), else a TypeError."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise TypeError(f"the FP8 GEMMs write bfloat16 or float32, got {dtype}")
    return jnp.dtype(dtype)


def swiglu_grad(gate_up: jax.Array, dh: jax.Array) -> jax.Array:
    """dz: SwiGLU's derivative at float32 `gate_up` applied to `dh`, in float32."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    return jnp.concatenate([dh * up * sig * (1 + gate * (1 - sig)), dh * silu], axis=-1)


# The routing-weight gradient's rounding. `d weights = <q(h), g>` per row is the one float32 reduction of the
# kernels' backward that runs outside a kernel, so its order and rounding are fixed here, not left to the compiler:
# XLA picks a reduction's order, and whether it fuses a product into the add that consumes it (one rounding instead
# of two), per fusion, so the same expression may round differently in two programs. The order is the one the g
# GEMM's epilogue computes from its accumulator tile (sm90 wgmma layout: a row's 128 columns of a tile sit in a quad
# of threads, thread q holding columns 8j + 2q + b for j = 0..15, b = 0, 1, in that order).
QUAD = 4  # the threads that share a row of a wgmma accumulator tile


def tile_dots(h: jax.Array, g: jax.Array) -> jax.Array:
    """`[R, C/128]` float32: per row and 128-column tile, `sum_c h[r, c] * g[r, c]` in the epilogue's order: each
    product rounded to float32 (materialised, so that no compiler fuses it into an add), thread q's 32 products added
    in (j, b) order starting from the first, then the quad's sums as `(s0 + s1) + (s2 + s3)`. `h`, `g` float32
    `[R, C]`, C a multiple of 128."""
    rows, cols = h.shape
    products = jax.lax.optimization_barrier(h * g)
    products = products.reshape(rows, cols // BLOCK, BLOCK // (2 * QUAD), QUAD, 2)  # [R, tile, j, q, b]
    acc = products[:, :, 0, :, 0]
    for j in range(BLOCK // (2 * QUAD)):
        for b in range(2):
            if j or b:
                acc = acc + products[:, :, j, :, b]
    return (acc[..., 0] + acc[..., 1]) + (acc[..., 2] + acc[..., 3])


def sum_in_order(parts: jax.Array) -> jax.Array:
    """`[R]`: `parts [R, n]` added along n in order, starting from the first (n >= 1)."""
    acc = parts[:, 0]
    for i in range(1, parts.shape[1]):
        acc = acc + parts[:, i]
    return acc


def row_dots(h: jax.Array, g: jax.Array) -> jax.Array:
    """`[R]` float32 `<h[r], g[r]>`: each tile's `tile_dots`, the tiles added in column order."""
    return sum_in_order(tile_dots(h, g))


def pad_hidden(a: jax.Array) -> jax.Array:
    """`a [T, H]` zero-padded to H a multiple of `BLOCK`."""
    return jnp.pad(a, ((0, 0), (0, round_up(a.shape[1]) - a.shape[1])))


def pad_weights(w_gate_up: jax.Array, w_down: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The expert weights with H and I zero-padded to multiples of `BLOCK`, the gate and up halves of `w_gate_up`
    separately, so that no block straddles them."""
    inter, hidden = w_down.shape[1:]
    hidden_p, inter_p = round_up(hidden), round_up(inter)
    if (hidden_p, inter_p) == (hidden, inter):
        return w_gate_up, w_down
    gate, up = jnp.split(w_gate_up, 2, axis=-1)
    pad = ((0, 0), (0, hidden_p - hidden), (0, inter_p - inter))
    gate_up = jnp.concatenate([jnp.pad(gate, pad), jnp.pad(up, pad)], axis=-1)
    return gate_up, jnp.pad(w_down, ((0, 0), (0, inter_p - inter), (0, hidden_p - hidden)))


def unpad_gate_up(dw: jax.Array, hidden: int, inter: int) -> jax.Array:
    """The gradient of `pad_weights`' `w_gate_up`, `[E, Hp, 2Ip]`, cut back to `[E, H, 2I]`."""
    gate, up = jnp.split(dw, 2, axis=-1)
    return jnp.concatenate([gate[:, :hidden, :inter], up[:, :hidden, :inter]], axis=-1)


# ---------------------------------------------------------------------------------------------------------------
# The reference: the GEMMs in float32 on the fake-quantised operands, over the unpadded expert-sorted rows.


def _rows(a):  # [R, C]: 1x128 tiles along the last (contraction) dimension
    return fake_quantize(a, (1, BLOCK))


def _blocks(w):  # [E, R, C]: 128x128 blocks per expert
    return fake_quantize(w, (1, BLOCK, BLOCK))


def _row_expert(layout: Layout) -> jax.Array:
    """The expert of each row of `layout`, E for the rows past the last expert's."""
    index = jnp.arange(layout.pair_of_row.size, dtype=jnp.int32)
    return (jnp.searchsorted(layout.expert_offsets, index, side="right") - 1).astype(jnp.int32)


def _token_tiles(rows: jax.Array, layout: Layout, expert: jax.Array) -> jax.Array:
    """`rows [P, C]` fake-quantised in tiles of 128 rows of one expert along the token (contraction) dimension
    of the weight-gradient GEMMs, one scale per (tile, column), counted from each expert's first row; dropped rows
    become zero."""
    num_experts = layout.expert_offsets.size - 1
    tiles_per_expert = -(-rows.shape[0] // BLOCK)
    position = jnp.arange(rows.shape[0], dtype=jnp.int32) - layout.expert_offsets[expert]
    valid = expert < num_experts
    tile = jnp.where(valid, expert * tiles_per_expert + position // BLOCK, num_experts * tiles_per_expert)
    amax = jax.ops.segment_max(jnp.abs(rows), tile, num_segments=num_experts * tiles_per_expert)
    scale = tile_scale(jnp.maximum(amax, 0))  # segment_max gives -inf for empty tiles
    scale = jnp.concatenate([scale, jnp.ones((1, rows.shape[1]), jnp.float32)])[tile]
    values = to_fp8(rows, scale).astype(jnp.float32) * scale
    return jnp.where(valid[:, None], values, 0)


def _mm(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _grouped(rows: jax.Array, w: jax.Array, expert: jax.Array) -> jax.Array:
    """`rows[r] @ w[expert[r]]` (zero for dropped rows): every row through every expert, then each row's pick; a
    map over experts, so that the compiled program does not grow with E (clarity over speed)."""
    every = jax.lax.map(lambda w_e: _mm(rows, w_e), w)  # [E, P, N]
    picked = every[jnp.clip(expert, 0, w.shape[0] - 1), jnp.arange(rows.shape[0])]
    return jnp.where((expert < w.shape[0])[:, None], picked, 0)


def _per_expert_outer(a: jax.Array, b: jax.Array, expert: jax.Array, num_experts: int) -> jax.Array:
    """`[E, A, B]`: `sum_{r of expert e} a[r]^T b[r]`."""
    return jax.lax.map(
        lambda e: _mm(jnp.where((expert == e)[:, None], a, 0).T, b), jnp.arange(num_experts, dtype=expert.dtype)
    )


class _Operands(NamedTuple):
    x: jax.Array  # [T, Hp] fake-quantised rows
    w_gate_up: jax.Array  # [E, Hp, 2Ip] fake-quantised blocks
    w_down: jax.Array  # [E, Ip, Hp]
    weights: jax.Array  # [P] float32 routing weight of each sorted row (0 when dropped)


def _operands(x, weights, w_gate_up, w_down, pair, expert) -> _Operands:
    wgu, wd = pad_weights(w_gate_up, w_down)
    row_weights = jnp.where(expert < w_gate_up.shape[0], weights.reshape(-1)[pair].astype(jnp.float32), 0)
    return _Operands(_rows(pad_hidden(x)), _blocks(wgu), _blocks(wd), row_weights)


def _sorted_pairs(layout: Layout, expert: jax.Array) -> jax.Array:
    """The pair of each row, 0 for the rows past the last expert's (masked wherever read)."""
    return jnp.where(expert < layout.expert_offsets.size - 1, layout.pair_of_row, 0)


def _hidden(gate_up, dtype):
    """q(h): SwiGLU of the saved projections in x's dtype, fake-quantised along I."""
    return _rows(round_to(swiglu(gate_up.astype(jnp.float32)), dtype))


@jax.custom_vjp
def _moe_ffn_fp8(x, weights, experts, w_gate_up, w_down):
    return _moe_ffn_fp8_fwd(x, weights, experts, w_gate_up, w_down)[0]


def _moe_ffn_fp8_fwd(x, weights, experts, w_gate_up, w_down):
    num_experts, top_k = w_gate_up.shape[0], experts.shape[1]
    layout = Layout(*(checkpoint_name(a, LAYOUT_NAME) for a in moe_layout(experts, num_experts, "reference")))
    expert = _row_expert(layout)
    pair = _sorted_pairs(layout, expert)
    ops = _operands(x, weights, w_gate_up, w_down, pair, expert)
    gate_up = checkpoint_name(round_to(_grouped(ops.x[pair // top_k], ops.w_gate_up, expert), x.dtype), GATE_UP_NAME)
    out = _grouped(_hidden(gate_up, x.dtype), ops.w_down, expert)
    y = jax.ops.segment_sum(ops.weights[:, None] * out, pair // top_k, num_segments=x.shape[0])
    return y[:, : x.shape[1]].astype(x.dtype), (x, weights, experts, w_gate_up, w_down, gate_up, layout)


def _moe_ffn_fp8_bwd(residuals, dy):
    x, weights, experts, w_gate_up, w_down, gate_up, layout = residuals
    num_experts, top_k, hidden, inter = w_gate_up.shape[0], experts.shape[1], x.shape[1], w_down.shape[1]
    expert = _row_expert(layout)
    pair = _sorted_pairs(layout, expert)
    token = pair // top_k
    ops = _operands(x, weights, w_gate_up, w_down, pair, expert)  # recomputed: the same values as the forward's
    hq = _hidden(gate_up, x.dtype)
    dyq = _rows(pad_hidden(dy.astype(x.dtype)))[token]
    g = _grouped(dyq, jnp.swapaxes(ops.w_down, 1, 2), expert)  # q(dy) . q(Wd)^T
    d_row_weights = jnp.sum(hq * g, axis=-1)
    dz = swiglu_grad(gate_up.astype(jnp.float32), ops.weights[:, None] * g)
    dzq = _rows(dz)
    dx_rows = _grouped(dzq, jnp.swapaxes(ops.w_gate_up, 1, 2), expert)
    dx = jax.ops.segment_sum(dx_rows, token, num_segments=x.shape[0])[:, :hidden]
    d_weights = jnp.zeros(weights.size, jnp.float32).at[pair].add(jnp.where(expert < num_experts, d_row_weights, 0))
    d_w_down = _per_expert_outer(
        _token_tiles(hq, layout, expert),
        _token_tiles(ops.weights[:, None] * dyq, layout, expert),
        expert,
        num_experts,
    )
    d_w_gate_up = _per_expert_outer(
        _token_tiles(ops.x[token], layout, expert),
        _token_tiles(dzq, layout, expert),
        expert,
        num_experts,
    )
    d_experts = np.zeros(experts.shape, jax.dtypes.float0)
    return (
        dx.astype(x.dtype),
        d_weights.reshape(weights.shape).astype(weights.dtype),
        d_experts,
        unpad_gate_up(d_w_gate_up, hidden, inter).astype(w_gate_up.dtype),
        d_w_down[:, :inter, :hidden].astype(w_down.dtype),
    )


_moe_ffn_fp8.defvjp(_moe_ffn_fp8_fwd, _moe_ffn_fp8_bwd)

# ---------------------------------------------------------------------------------------------------------------
# The entry point moe_ffn dispatches to.


def _dtype_stand_in(value, dtype):
    """A zero-memory array of `value`'s shape in `dtype`, so that moe_ffn's checks (which want one dtype) run on the
    shapes while the recipe accepts weights in their master dtype."""
    return np.broadcast_to(np.zeros((), dtype), np.shape(value))


def check_fp8_args(
    x, weights, experts, w_gate_up, w_down, implementation: str | None = None, num_experts=None
) -> tuple[int, int, int, int, int]:
    """The recipe's checks (`implementation` resolved: "cpu", "cuda" or "reference"; None skips its check);
    returns `check_moe_args`'s `(T, H, I, E_local, K)`."""
    check_rank("x", x, 2, "[T, H]")
    check_rank("w_gate_up", w_gate_up, 3, "[E, H, 2I]")
    check_rank("w_down", w_down, 3, "[E, I, H]")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_float(name, w)
        if jnp.dtype(w.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise TypeError(
                f"recipe='fp8_blockwise' takes {name} in bfloat16 or float32 (master weights), got {w.dtype}"
            )
    sizes = check_moe_args(
        x,
        weights,
        experts,
        _dtype_stand_in(w_gate_up, x.dtype),
        _dtype_stand_in(w_down, x.dtype),
        num_experts=num_experts,
    )
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        raise TypeError(
            f"recipe='fp8_blockwise' needs bfloat16 x (its outputs and saved projections are in x's "
            f"dtype), got {x.dtype}: cast x to bfloat16, or use recipe=None"
        )
    if implementation == "cuda":
        check_fp8_tensor_cores()
    return sizes


def check_fp8_tensor_cores() -> None:
    """The recipe's CUDA kernels are sm90a (Hopper) FP8 wgmma GEMMs: other GPUs get a clear error."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    capabilities = sorted({str(getattr(d, "compute_capability", "unknown")) for d in gpus})
    if not gpus or any(not c.startswith("9.") for c in capabilities):
        raise ValueError(
            "recipe='fp8_blockwise' with implementation='cuda' runs on Hopper FP8 tensor cores (compute capability "
            f"9.x); these GPUs have {capabilities or 'none'}: use implementation='reference'"
        )


@functools.partial(jax.jit, inline=True)
def moe_ffn_fp8(x, weights, experts, w_gate_up, w_down):
    """`moe_ffn` with recipe="fp8_blockwise", arguments already checked (see `check_fp8_args`)."""
    return _moe_ffn_fp8(x, weights, experts, w_gate_up, w_down)
