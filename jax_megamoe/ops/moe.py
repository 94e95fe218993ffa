"""The MoE expert FFN: dispatch, SwiGLU experts and weighted combine, as FFI kernels with a custom VJP.

Four FFI ops per platform (targets in jax_megamoe/_targets.py, handlers in cuda/ffi/moe_{cpu,cuda}.cc):
  moe_layout   expert ids -> stable expert-sorted row order (ids outside [0, E) are dropped)
  moe_gate_up  the gate/up projections of the sorted rows, saved for the backward
  moe_down     y from them: SwiGLU, the down projection and the weighted combine
  moe_backward dx, d weights, d w_gate_up, d w_down
The forward is two calls so that under jax.checkpoint the backward's recomputation runs moe_gate_up alone:
it needs only the saved projections, and XLA drops the moe_down whose y nothing reads there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_megamoe import _ffi, _targets, reference
from jax_megamoe.ops import fp8, fp8_gemms
from jax_megamoe.ops.gemm_config import GemmConfig
from jax_megamoe.ops.layout import Layout, drop_invalid_ids, moe_layout
from jax_megamoe.ops.validation import check_moe_args

IMPLEMENTATIONS = ("auto", "cpu", "cuda", "reference")

# dtypes each kernel platform implements; "reference" takes any float dtype. On "cuda", bf16 with H and I
# multiples of 8 runs on tensor cores (CUTLASS sm90 grouped GEMMs); float32 and other bf16 shapes run an
# exact float32-FMA SIMT path (no tf32), correct but slow.
KERNEL_DTYPES = {
    "cpu": (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64),
    "cuda": (jnp.bfloat16, jnp.float32),
}

_JAX_PLATFORM = {"cpu": "cpu", "cuda": "gpu"}

# `jax.ad_checkpoint.checkpoint_name`s of the residuals the backward needs besides the inputs: a checkpoint
# policy that saves them (`jax.checkpoint_policies.save_only_these_names(LAYOUT_NAME, GATE_UP_NAME)`) recomputes
# nothing of moe_ffn, at the memory of gate_up ([T*K, 2I] in x's dtype) and the layout ([2*T*K + E + 1] int32).
LAYOUT_NAME = "moe_layout"
GATE_UP_NAME = "moe_gate_up"


def _array_platforms(arrays) -> set[str]:
    """The platforms of the devices that concrete arrays live on (tracers have none)."""
    platforms: set[str] = set()
    for a in arrays:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            platforms.update(d.platform for d in a.devices())
    return platforms


def resolve_implementation(implementation: str, arrays=()) -> str:
    """Maps `implementation` to `"cpu"`, `"cuda"` or `"reference"`, raising where it cannot run.

    `"auto"` follows the platform the concrete `arrays` live on, else `jax.default_backend()`: the CUDA
    kernels on a GPU, the CPU kernels on a CPU, the reference where no kernel for the platform was built.
    A program compiled for another platform than the chosen kernels' fails at lowering (`_ffi.call`).
    """
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    platforms = _array_platforms(arrays) or {jax.default_backend()}
    if implementation == "auto":
        if platforms == {"gpu"} and _ffi.has_cuda_kernels():
            return "cuda"
        if platforms == {"cpu"} and _ffi.has_cpu_kernels():
            return "cpu"
        return "reference"
    if implementation == "reference":
        return implementation
    if implementation == "cuda" and not _ffi.has_cuda_kernels():
        raise ValueError(
            "implementation='cuda' needs jax_megamoe built with its CUDA kernels (nvcc present at "
            "install time, JMM_CUDA not OFF); this build has none: use implementation='auto'"
        )
    if implementation == "cpu" and not _ffi.has_cpu_kernels():
        raise ValueError("implementation='cpu' needs jax_megamoe's compiled extension; reinstall with `pip install .`")
    wanted = _JAX_PLATFORM[implementation]
    if platforms != {wanted}:
        if _array_platforms(arrays):
            where = f"the arrays live on {' and '.join(sorted(platforms))} devices"
        else:
            where = f"jax.default_backend() is {jax.default_backend()!r}"
        raise ValueError(
            f"implementation={implementation!r} runs on {wanted} devices, but {where}: use implementation='auto' "
            "or the one for that platform"
        )
    return implementation


def _sizes(x, weights, w_gate_up) -> tuple:
    """The problem sizes the CUDA handlers' workspace queries take."""
    (tokens, hidden), top_k = x.shape, weights.shape[1]
    experts, _, two_inter = w_gate_up.shape
    return (bool(x.dtype == jnp.bfloat16), tokens, top_k, hidden, two_inter // 2, experts)


def _tiles(implementation: str, **tiles) -> dict:
    """The GEMM tile attributes: the CUDA handlers take them, the CPU ones none."""
    return {name: np.int64(value) for name, value in tiles.items()} if implementation == "cuda" else {}


def _forward(implementation, config, x, weights, w_gate_up, w_down, layout):
    """`(y, gate_up)`: the two forward calls (see the module docstring)."""
    sizes = _sizes(x, weights, w_gate_up)
    gate_up_shape = jax.ShapeDtypeStruct((layout.pair_of_row.shape[0], w_gate_up.shape[2]), x.dtype)
    [gate_up] = _ffi.call(
        _targets.MOE_GATE_UP[implementation],
        (gate_up_shape,),
        x,
        w_gate_up,
        layout.pair_of_row,
        layout.expert_offsets,
        workspace_args=sizes,
        **_tiles(implementation, fwd_gate_up_tiles=config.fwd_gate_up),
    )
    [y] = _ffi.call(
        _targets.MOE_DOWN[implementation],
        (jax.ShapeDtypeStruct(x.shape, x.dtype),),
        gate_up,
        weights,
        w_down,
        layout.row_of_pair,
        layout.expert_offsets,
        workspace_args=sizes,
        **_tiles(implementation, fwd_down_tiles=config.fwd_down),
    )
    return y, gate_up


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _moe_ffn_kernels(x, weights, experts, w_gate_up, w_down, implementation, config):
    """`moe_ffn` on the kernels of `implementation`; weights float32 (float64 for float64 x), experts int32."""
    return _moe_ffn_kernels_fwd(x, weights, experts, w_gate_up, w_down, implementation, config)[0]


def _moe_ffn_kernels_fwd(x, weights, experts, w_gate_up, w_down, implementation, config):
    layout = moe_layout(experts, w_gate_up.shape[0], implementation)
    layout = Layout(*(checkpoint_name(a, LAYOUT_NAME) for a in layout))
    y, gate_up = _forward(implementation, config, x, weights, w_gate_up, w_down, layout)
    x, weights, layout, gate_up = _ffi.residuals((x, weights, layout, gate_up))
    return y, (x, weights, w_gate_up, w_down, checkpoint_name(gate_up, GATE_UP_NAME), layout)


def _moe_ffn_kernels_bwd(implementation, config, residuals, dy):
    x, weights, w_gate_up, w_down, gate_up, layout = residuals
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, weights, w_gate_up, w_down)]
    if implementation == "cuda":  # dz, the gradient of gate_up, written over gate_up (garbage to us)
        shapes.append(jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype))
    dx, d_weights, d_w_gate_up, d_w_down = _ffi.call(
        _targets.MOE_BACKWARD[implementation],
        shapes,
        dy.astype(x.dtype),
        x,
        weights,
        w_gate_up,
        w_down,
        gate_up,
        *layout,
        workspace_args=_sizes(x, weights, w_gate_up),
        **_tiles(implementation, bwd_down_tiles=config.bwd_down, bwd_gate_up_tiles=config.bwd_gate_up),
    )[:4]
    return dx, d_weights, None, d_w_gate_up, d_w_down


_moe_ffn_kernels.defvjp(_moe_ffn_kernels_fwd, _moe_ffn_kernels_bwd)


def kernel_operands(x, weights, experts, w_gate_up, w_down, implementation: str):
    """Checks x's dtype against the kernels of `implementation` and returns the operands as the kernels take
    them: routing weights in the accumulation dtype, expert ids int32 with the invalid ones at -1, all marked
    alike for `shard_map`."""
    supported = [jnp.dtype(d) for d in KERNEL_DTYPES[implementation]]
    if jnp.dtype(x.dtype) not in supported:
        raise TypeError(
            f"implementation={implementation!r} supports x dtypes {[str(d) for d in supported]}, got {x.dtype}"
        )
    weights_dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return _ffi.vary_alike(
        x, weights.astype(weights_dtype), drop_invalid_ids(experts, w_gate_up.shape[0]), w_gate_up, w_down
    )


def moe_ffn(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    implementation: str = "auto",
    gemm_config: GemmConfig | None = None,
    recipe: str | None = None,
) -> jax.Array:
    """Mixture-of-experts SwiGLU FFN: `y[t] = sum_k weights[t, k] * f_{experts[t, k]}(x[t])`.

    Args:
      x: `[T, H]` tokens.
      weights: `[T, K]` routing weights (any float dtype; float32 inside the kernels, float64 for float64 x).
      experts: `[T, K]` integer expert ids of any integer dtype. Pairs whose id lies outside `[0, E)` are
        dropped: they contribute zero to `y` and get zero gradient. No kernel reads or writes out of bounds.
      w_gate_up: `[E, H, 2I]`, gate in `[..., :I]`, up in `[..., I:]`; same dtype as `x`.
      w_down: `[E, I, H]`; same dtype as `x`.
      implementation: `"auto"` (the kernels of the platform the arrays live on, else of
        `jax.default_backend()`), `"cpu"`, `"cuda"` or `"reference"` (pure JAX).
      gemm_config: the CUDA GEMMs' tiles; None picks them by shape (`GemmConfig.for_problem`).
      recipe: None computes in x's dtype; `"fp8_blockwise"` runs every expert GEMM on e4m3 operands with
        blockwise float32 scales (bfloat16 x; weights bfloat16 or float32; see jax_megamoe/ops/fp8.py and
        docs/fp8.md): "cuda" on Hopper's FP8 tensor cores, "cpu" by emulating those GEMMs in float32,
        "reference" as the quantisation-exact pure-JAX reference.

    Returns `[T, H]` in x's dtype, accumulated in float32 (float64 for float64 inputs).
    Differentiable in `x`, `weights`, `w_gate_up` and `w_down`.

    Under `jax.checkpoint` the kernels' backward recomputes the layout and the gate/up projections only. A policy
    saving the names `"moe_layout"` and `"moe_gate_up"` (`jax.checkpoint_policies.save_only_these_names`)
    recomputes nothing of it, at the memory of the projections (`[T*K, 2I]` in x's dtype).
    """
    fp8.check_recipe(recipe)
    if recipe is not None:  # the FP8 recipe: ops/fp8.py (rule, reference), ops/fp8_gemms.py (kernels)
        implementation = resolve_implementation(implementation, (x, weights, experts, w_gate_up, w_down))
        fp8.check_fp8_args(x, weights, experts, w_gate_up, w_down, implementation)
        args = _ffi.vary_alike(x, weights, drop_invalid_ids(experts, w_gate_up.shape[0]), w_gate_up, w_down)
        if implementation == "reference":
            return fp8.moe_ffn_fp8(*args)
        return fp8_gemms.moe_ffn_fp8(*args, implementation)
    tokens, hidden, inter, experts_count, top_k = check_moe_args(x, weights, experts, w_gate_up, w_down)
    if gemm_config is not None and not isinstance(gemm_config, GemmConfig):
        raise TypeError(f"gemm_config must be None or a jax_megamoe.GemmConfig, got {gemm_config!r}")
    implementation = resolve_implementation(implementation, (x, weights, experts, w_gate_up, w_down))
    if implementation == "reference":
        return reference.moe_ffn(x, weights, experts, w_gate_up, w_down)
    config = gemm_config or GemmConfig.for_problem(tokens, top_k, hidden, inter, experts_count)
    args = kernel_operands(x, weights, experts, w_gate_up, w_down, implementation)
    return _moe_ffn_kernels(*args, implementation, config)
