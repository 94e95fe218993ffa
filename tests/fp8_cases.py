"""The "fp8_blockwise" recipe's test problems, a numpy implementation of its rule (float32, as the rule states it)
and of its quantised math in float64 around the rule (`oracle`), and the test base every implementation of its
kernels subclasses (tests/test_fp8.py: "cpu", the GEMMs emulated; tests/test_fp8_gpu.py: "cuda"): value and every
gradient against the oracle on fresh random inputs, over the edge cases of the padded row layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from moe_cases import OUTPUT_NAMES, Case, make_problem, rel_error, seeded_rng, value_and_grads

import jax_megamoe as jmm

RECIPE = "fp8_blockwise"


def recipe_problem(case: Case, seed="fp8"):
    """bf16 x and dy, float32 master weights (bf16-representable, so the float64 oracles see the same values)."""
    (x, weights, ids, w_gate_up, w_down), dy = make_problem(case, jnp.bfloat16, seed=seed)
    return (x, weights, ids, w_gate_up.astype(jnp.float32), w_down.astype(jnp.float32)), dy


@functools.cache
def recipe_value_and_grads(implementation: str):
    fn = functools.partial(jmm.moe_ffn, implementation=implementation, recipe=RECIPE)
    return jax.jit(functools.partial(value_and_grads, fn))


def recipe_outputs(args, dy, implementation="reference"):
    return tuple(np.asarray(o.astype(jnp.float32)) for o in recipe_value_and_grads(implementation)(tuple(args), dy))


# ---------------------------------------------------------------------------------------------------------------
# A numpy implementation of the rule, independent of XLA's and ml_dtypes' float8 conversions.


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto the e4m3fn grid (3 mantissa bits, subnormals below 2**-6), |v| <= 448."""
    v = np.asarray(v, np.float64)
    a = np.abs(v)
    exponent = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6)
    step = 2.0 ** (exponent - 3)
    return np.sign(v) * np.minimum(np.round(a / step) * step, 448.0)  # np.round: ties to even


def np_quantize_tiles(tiles: np.ndarray, axis) -> tuple[np.ndarray, np.ndarray]:
    """The rule over `axis` of `tiles`, its arithmetic in float32 as the rule states it (scale = amax / 448, the
    values' division, IEEE-rounded; round-to-nearest-even onto e4m3): (values as float64, float32 scales with the
    reduced axes kept). The rule's float32 arithmetic matters: the same steps in float64 land on the other side of an
    e4m3 rounding tie often enough to move results by about 1e-2."""
    tiles = np.asarray(tiles, np.float32)
    amax = np.max(np.abs(tiles), axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    return e4m3_round(np.clip(tiles / scale, -448, 448).astype(np.float32)), scale


def np_quantize_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1x128 tiles along the last axis: (values, scales `[..., C/128]`)."""
    values, scale = np_quantize_tiles(np.reshape(a, a.shape[:-1] + (a.shape[-1] // 128, 128)), -1)
    return values.reshape(a.shape), scale[..., 0]


def _qdq_rows(a):
    values, scale = np_quantize_rows(a)
    return (values.reshape(a.shape[:-1] + (-1, 128)) * scale[..., None]).reshape(a.shape)


def qdq_blocks(w):  # [R, C] in 128x128 blocks
    r, c = w.shape
    values, scale = np_quantize_tiles(w.reshape(r // 128, 128, c // 128, 128), (1, 3))
    return (values * scale).reshape(w.shape)


def _qdq_tokens(a):  # [n, C]: tiles of 128 consecutive rows (the last one padded with zeros), a scale per column
    padded = np.pad(a, ((0, _up(a.shape[0]) - a.shape[0]), (0, 0)))
    values, scale = np_quantize_tiles(padded.reshape(-1, 128, a.shape[1]), 1)
    return (values * scale).reshape(padded.shape)[: a.shape[0]]


def _up(n):
    return -(-n // 128) * 128


def np_quantize_blocks(w: np.ndarray, transpose: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """`w [E, A, B]` in 128x128 blocks -> (values, float32 scales `[E, A/128, B/128]`), as the rows GEMM's operand:
    transposed with `transpose`."""
    e, a, b = w.shape
    values, scale = np_quantize_tiles(w.reshape(e, a // 128, 128, b // 128, 128), (2, 4))
    values, scale = values.reshape(w.shape), scale[:, :, 0, :, 0]
    return (np.swapaxes(values, 1, 2), np.swapaxes(scale, 1, 2)) if transpose else (values, scale)


def np_tile_dots(h: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The routing-weight gradient's order (`fp8.tile_dots`) in numpy float32: per row and 128-column tile, the
    products rounded, each of the four quad threads' 32 products (columns 8j + 2q + b, j then b ascending) added from
    the first, then `(s0 + s1) + (s2 + s3)`. `[R, C/128]`."""
    products = np.asarray(h, np.float32) * np.asarray(g, np.float32)
    rows, cols = products.shape
    out = np.empty((rows, cols // 128), np.float32)
    for tile in range(cols // 128):
        sums = []
        for q in range(4):
            columns = [128 * tile + 8 * j + 2 * q + b for j in range(16) for b in range(2)]
            acc = products[:, columns[0]]
            for c in columns[1:]:
                acc = acc + products[:, c]
            sums.append(acc)
        out[:, tile] = (sums[0] + sums[1]) + (sums[2] + sums[3])
    return out


def tile_dots_problem(seed, rows=300, cols=384) -> tuple[np.ndarray, np.ndarray]:
    """h as the dequantised q(h) (e4m3 values times a float32 scale per 1x128 tile, one tile all zero) and float32 g
    over a wide range: sums whose order shows in their last bits."""
    rng = seeded_rng("fp8 tile dots", seed)
    e4m3 = np.clip(rng.standard_normal((rows, cols)) * 100, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    values = e4m3.astype(np.float32)
    scales = np.exp(rng.uniform(-6, 3, (rows, cols // 128, 1))).astype(np.float32)
    h = (values.reshape(rows, -1, 128) * scales).reshape(rows, cols)
    h[1, :128] = 0
    g = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-4, 4, (rows, 1)))).astype(np.float32)
    return h, g


def block_quantizer_problem(dtype, transpose) -> np.ndarray:
    """Weights `[3, 256, 384]` as float32 holding `dtype`'s values: columns of very different ranges, an all-zero
    block (scale 1) and a block of subnormal e4m3 values."""
    rng = seeded_rng("fp8 weight blocks", str(jnp.dtype(dtype)), transpose)
    w = rng.standard_normal((3, 256, 384)) * np.exp(rng.uniform(-6, 6, (3, 1, 384)))
    w[1, 128:, :128] = 0
    w[2, :128, 128:256] *= 1e-30
    return np.asarray(jnp.asarray(w, dtype).astype(jnp.float32))


def oracle(args, dy, quantized: bool):
    """float64 `(y, dx, d_weights, d_w_gate_up, d_w_down)` of the recipe's math (quantized: with its quantisers in
    the rule's float32 arithmetic and its roundings of gate_up and h to bf16) or of the plain MoE."""
    x, weights, ids, w_gate_up, w_down = (
        np.asarray(a, np.float64) if i != 2 else np.asarray(a) for i, a in enumerate(args)
    )
    dy = np.asarray(dy, np.float64)
    (t, h), (e_count, _, i2), k = x.shape, w_gate_up.shape, ids.shape[1]
    i = i2 // 2
    hp, ip = _up(h), _up(i)
    ident = lambda a: a  # noqa: E731
    x_dtype = (lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)) if quantized else ident
    rows, blocks, tokens = (_qdq_rows, qdq_blocks, _qdq_tokens) if quantized else (ident, ident, ident)
    xq = rows(np.pad(x, ((0, 0), (0, hp - h))))
    dyq = rows(np.pad(dy, ((0, 0), (0, hp - h))))
    pad_w = ((0, hp - h), (0, ip - i))
    y, dx = np.zeros((t, hp)), np.zeros((t, hp))
    d_weights, d_wgu, d_wd = np.zeros((t, k)), np.zeros((e_count, h, i2)), np.zeros((e_count, i, h))
    for e in range(e_count):
        tok, kk = np.nonzero(ids == e)  # row-major: the stable (token, k) order
        if tok.size == 0:
            continue
        wgu = blocks(np.concatenate([np.pad(w_gate_up[e, :, :i], pad_w), np.pad(w_gate_up[e, :, i:], pad_w)], 1))
        wd = blocks(np.pad(w_down[e], ((0, ip - i), (0, hp - h))))
        we = weights[tok, kk][:, None]
        gate_up = x_dtype(xq[tok] @ wgu)  # the recipe stores gate_up and h in x's dtype (bf16)
        gate, up = gate_up[:, :ip], gate_up[:, ip:]
        sig = 1 / (1 + np.exp(-gate))
        hq = rows(x_dtype(gate * sig * up))
        np.add.at(y, tok, we * (hq @ wd))
        g = dyq[tok] @ wd.T
        d_weights[tok, kk] = np.sum(hq * g, axis=1)
        dh = we * g
        dzq = rows(np.concatenate([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], 1))
        np.add.at(dx, tok, dzq @ wgu.T)
        d_wd[e] = (tokens(hq).T @ tokens(we * dyq[tok]))[:i, :h]
        full = tokens(xq[tok]).T @ tokens(dzq)
        d_wgu[e] = np.concatenate([full[:h, :i], full[:h, ip : ip + i]], 1)
    return y[:, :h], dx[:, :h], d_weights, d_wgu, d_wd


class Fp8KernelsBase:
    """Subclasses set `implementation` and the `cases` they run (small on CPU, where the reference is slow)."""

    implementation: str
    cases: tuple[Case, ...] = (
        Case(64, 256, 128, 8, 2),  # q30-like ratios, one token tile per expert
        Case(300, 256, 128, 4, 2, "zipf"),  # experts past 128 rows: several token tiles, ragged last ones
        Case(96, 136, 72, 8, 2, "empty_experts"),  # H, I not multiples of 128; experts without rows
        Case(64, 128, 128, 4, 1),  # K = 1
        Case(130, 128, 256, 4, 3, "all_to_one"),  # every pair on one expert
        Case(64, 128, 128, 8, 2, "out_of_range"),  # dropped pairs (ids outside [0, E))
    )

    def prepare(self):
        """Runs before each computation (the GPU subclass poisons device memory)."""

    def test_matches_the_quantized_math(self, case_index):
        """Value and every gradient within 1e-2 (normwise) of the numpy computation of the recipe's
        quantised math (`oracle`), a host computation that no platform's arithmetic enters."""
        case = self.cases[case_index]
        args, dy = recipe_problem(case, seed=("fp8 kernels", self.implementation))
        self.prepare()
        got = recipe_outputs(args, dy, self.implementation)
        want = oracle(args, dy, quantized=True)
        for name, a, b in zip(OUTPUT_NAMES, got, want, strict=True):
            assert np.all(np.isfinite(a)), (case, name)
            assert rel_error(a, b) < 1e-2, (case, name, rel_error(a, b))

    def test_outputs_in_x_dtype_and_weight_gradients_in_weights_dtype(self):
        args, dy = recipe_problem(self.cases[0])
        bf16_weights = (*args[:3], args[3].astype(jnp.bfloat16), args[4].astype(jnp.bfloat16))
        for implementation in (self.implementation, "reference"):
            fn = recipe_value_and_grads(implementation)
            out = jax.eval_shape(fn, tuple(args), dy)
            assert [o.dtype for o in out] == [jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32]
            assert [o.dtype for o in jax.eval_shape(fn, bf16_weights, dy)][3:] == [jnp.bfloat16, jnp.bfloat16]

    def test_deterministic(self):
        args, dy = recipe_problem(self.cases[1], seed="fp8 determinism")
        first = recipe_outputs(args, dy, self.implementation)
        self.prepare()
        for a, b in zip(first, recipe_outputs(args, dy, self.implementation), strict=True):
            np.testing.assert_array_equal(a, b)


def parametrize_cases(metafunc):
    """`pytest_generate_tests` of the modules with subclasses: `case_index` over the class's cases."""
    if "case_index" in metafunc.fixturenames:
        cases = metafunc.cls.cases
        metafunc.parametrize("case_index", range(len(cases)), ids=[str(c) for c in cases])
