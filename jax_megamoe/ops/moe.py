"""The MoE expert FFN: dispatch, SwiGLU experts and weighted combine, as FFI kernels with a custom VJP.

Four FFI ops per platform (contract in cuda/include/jmm/handlers.h):
  moe_layout   expert ids -> stable expert-sorted row order (ids outside [0, E) are dropped)
  moe_gate_up  the gate/up projections of the sorted rows, saved for the backward
  moe_down     y from them: SwiGLU, the down projection and the weighted combine
  moe_backward dx, d weights, d w_gate_up, d w_down
The forward is two calls so that under jax.checkpoint the backward's recomputation runs moe_gate_up alone:
it needs only the saved projections, and XLA drops the moe_down whose y nothing reads there.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_megamoe import _ffi, reference
from jax_megamoe.ops.validation import check_moe_args

BACKENDS = ("auto", "cpu", "cuda", "reference")

# dtypes each kernel platform implements; "reference" takes any float dtype. On "cuda", bf16 with H and I
# multiples of 8 runs on tensor cores (CUTLASS sm90 grouped GEMMs); float32 and other bf16 shapes run an
# exact float32-FMA SIMT path (no tf32), correct but slow.
KERNEL_DTYPES = {
    "cpu": (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64),
    "cuda": (jnp.bfloat16, jnp.float32),
}


def resolve_backend(backend: str) -> str:
    """Maps `backend` to `"cpu"`, `"cuda"` or `"reference"`, raising if the kernels are missing.

    `"auto"` follows `jax.default_backend()`: the CUDA kernels on a GPU, the CPU kernels on a CPU, the
    reference where no kernel for the platform was built.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        platform = jax.default_backend()
        if platform == "gpu" and _ffi.has_cuda_kernels():
            return "cuda"
        if platform == "cpu" and _ffi.has_cpu_kernels():
            return "cpu"
        return "reference"
    if backend == "cuda" and not _ffi.has_cuda_kernels():
        raise ValueError("backend='cuda' needs jax_megamoe built with its CUDA kernels (nvcc present at "
                         "install time, JMM_CUDA not OFF); this build has none")
    if backend == "cuda" and jax.default_backend() != "gpu":
        raise ValueError(f"backend='cuda' needs a GPU, but jax.default_backend() is {jax.default_backend()!r}")
    if backend == "cpu" and not _ffi.has_cpu_kernels():
        raise ValueError("backend='cpu' needs jax_megamoe's compiled extension; reinstall with `pip install .`")
    return backend


# `jax.ad_checkpoint.checkpoint_name`s of the residuals the backward needs besides the inputs: a checkpoint
# policy that saves them (`jax.checkpoint_policies.save_only_these_names(LAYOUT_NAME, GATE_UP_NAME)`) recomputes
# nothing of moe_ffn, at the memory of gate_up ([T*K, 2I] in x's dtype) and the layout ([2*T*K + E + 1] int32).
LAYOUT_NAME = "moe_layout"
GATE_UP_NAME = "moe_gate_up"

# Where `_moe_ffn_kernels_bwd` passes gate_up among the backward's operands (dy, x, weights, w_gate_up,
# w_down, gate_up, layout...).
_BACKWARD_GATE_UP_OPERAND = 5

# Read when a function is traced: the CUDA forward and backward get it as an attribute (grammar in
# cuda/include/jmm/gemm_tiles.h), so it is part of the compiled program; trace again to change it.
GEMM_TILES_ENV = "JMM_GEMM_TILES"


def _call(platform, op, result_shapes, dims, *args, **attrs):
    """`_ffi.call` of an MoE op. The CUDA handlers take one more result, last: their temporaries (a uint8
    workspace XLA allocates, so that it may capture them into CUDA graphs; handlers.h), dropped here.
    `dims` = (bfloat16, tokens, top_k, hidden, intermediate, experts) sizes it. The CUDA forward and
    backward also take the GEMM tiles (`GEMM_TILES_ENV`). The CUDA backward also returns dz, the gradient
    of gate_up, written over its gate_up operand (handlers.h; one rows x 2I buffer less), dropped here."""
    if platform != "cuda":
        return _ffi.call(platform, op, result_shapes, *args, **attrs)
    if op != "moe_layout":
        attrs["gemm_tiles"] = os.environ.get(GEMM_TILES_ENV, "")
    extra, aliases = (), None
    if op == "moe_backward":
        gate_up = args[_BACKWARD_GATE_UP_OPERAND]
        extra = (jax.ShapeDtypeStruct(gate_up.shape, gate_up.dtype),)
        aliases = {_BACKWARD_GATE_UP_OPERAND: len(result_shapes)}
    workspace = jax.ShapeDtypeStruct((_ffi.extension().cuda_workspace_bytes(op, *dims),), jnp.uint8)
    results = _ffi.call(platform, op, (*result_shapes, *extra, workspace), *args, input_output_aliases=aliases,
                        **attrs)
    return results[:len(result_shapes)]


def _dims(x, weights, w_gate_up):
    """The sizes `_call` passes for a forward or backward call."""
    (tokens, hidden), top_k = x.shape, weights.shape[1]
    experts, _, two_inter = w_gate_up.shape
    return (bool(x.dtype == jnp.bfloat16), tokens, top_k, hidden, two_inter // 2, experts)


class Layout(NamedTuple):
    """Expert-sorted order of the (token, k) pairs; see `moe_layout`."""
    row_of_pair: jax.Array     # [T*K] int32, -1 for dropped pairs
    pair_of_row: jax.Array     # [T*K] int32, -1 past the last valid row
    expert_offsets: jax.Array  # [E+1] int32


def moe_layout(experts: jax.Array, num_experts: int, platform: str) -> Layout:
    """Sorts the (token, k) pairs by expert id, stable in pair order, on `platform` ("cpu"/"cuda")."""
    num_pairs = experts.size
    shapes = (jax.ShapeDtypeStruct((num_pairs,), jnp.int32), jax.ShapeDtypeStruct((num_pairs,), jnp.int32),
              jax.ShapeDtypeStruct((num_experts + 1,), jnp.int32))
    dims = (False, *experts.shape, 0, 0, num_experts)
    return Layout(*_call(platform, "moe_layout", shapes, dims, experts.astype(jnp.int32),
                         num_experts=np.int64(num_experts)))


def _forward(platform, x, weights, w_gate_up, w_down, layout):
    """`(y, gate_up)`: the two forward calls (see the module docstring)."""
    dims = _dims(x, weights, w_gate_up)
    gate_up_shape = jax.ShapeDtypeStruct((layout.pair_of_row.shape[0], w_gate_up.shape[2]), x.dtype)
    [gate_up] = _call(platform, "moe_gate_up", (gate_up_shape,), dims, x, w_gate_up, layout.pair_of_row,
                      layout.expert_offsets)
    [y] = _call(platform, "moe_down", (jax.ShapeDtypeStruct(x.shape, x.dtype),), dims, gate_up, weights, w_down,
                layout.row_of_pair, layout.expert_offsets)
    return y, gate_up


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _moe_ffn_kernels(x, weights, experts, w_gate_up, w_down, platform):
    """`moe_ffn` on the kernels of `platform`; weights float32 (float64 for float64 x), experts int32."""
    return _moe_ffn_kernels_fwd(x, weights, experts, w_gate_up, w_down, platform)[0]


def _moe_ffn_kernels_fwd(x, weights, experts, w_gate_up, w_down, platform):
    layout = Layout(*(checkpoint_name(a, LAYOUT_NAME) for a in moe_layout(experts, w_gate_up.shape[0], platform)))
    y, gate_up = _forward(platform, x, weights, w_gate_up, w_down, layout)
    return y, (x, weights, w_gate_up, w_down, checkpoint_name(gate_up, GATE_UP_NAME), layout)


def _moe_ffn_kernels_bwd(platform, residuals, dy):
    x, weights, w_gate_up, w_down, gate_up, layout = residuals
    shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(weights.shape, weights.dtype),
              jax.ShapeDtypeStruct(w_gate_up.shape, w_gate_up.dtype),
              jax.ShapeDtypeStruct(w_down.shape, w_down.dtype))
    dx, d_weights, d_w_gate_up, d_w_down = _call(
        platform, "moe_backward", shapes, _dims(x, weights, w_gate_up), dy.astype(x.dtype), x, weights, w_gate_up,
        w_down, gate_up, *layout)
    return dx, d_weights, None, d_w_gate_up, d_w_down


_moe_ffn_kernels.defvjp(_moe_ffn_kernels_fwd, _moe_ffn_kernels_bwd)


def moe_ffn(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
            *, backend: str = "auto") -> jax.Array:
    """Mixture-of-experts SwiGLU FFN: `y[t] = sum_k weights[t, k] * f_{experts[t, k]}(x[t])`.

    Args:
      x: `[T, H]` tokens.
      weights: `[T, K]` routing weights (any float dtype; float32 inside the kernels, float64 for float64 x).
      experts: `[T, K]` integer expert ids. Pairs whose id lies outside `[0, E)` are dropped: they
        contribute zero to `y` and get zero gradient. No kernel reads or writes out of bounds for them.
      w_gate_up: `[E, H, 2I]`, gate in `[..., :I]`, up in `[..., I:]`; same dtype as `x`.
      w_down: `[E, I, H]`; same dtype as `x`.
      backend: `"auto"`, `"cpu"`, `"cuda"` or `"reference"` (pure JAX).

    Returns `[T, H]` in x's dtype, accumulated in float32 (float64 for float64 inputs).
    Differentiable in `x`, `weights`, `w_gate_up` and `w_down`.

    Under `jax.checkpoint` the kernels' backward recomputes the layout and the gate/up projections only. A policy
    saving the names `"moe_layout"` and `"moe_gate_up"` (`jax.checkpoint_policies.save_only_these_names`)
    recomputes nothing of it, at the memory of the projections (`[T*K, 2I]` in x's dtype).
    """
    check_moe_args(x, weights, experts, w_gate_up, w_down)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.moe_ffn(x, weights, experts, w_gate_up, w_down)
    supported = [jnp.dtype(d) for d in KERNEL_DTYPES[backend]]
    if jnp.dtype(x.dtype) not in supported:
        raise TypeError(f"backend={backend!r} supports x dtypes {[str(d) for d in supported]}, got {x.dtype}")
    weights_dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    args = _ffi.vary_alike(x, weights.astype(weights_dtype), experts.astype(jnp.int32), w_gate_up, w_down)
    return _moe_ffn_kernels(*args, backend)
