"""Loads the compiled extension, registers the FFI targets of `_targets.py`, and calls them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_megamoe import _targets
from jax_megamoe._targets import Target

_BY_NAME = {t.name: t for t in _targets.all_targets()}


@functools.cache
def extension():
    """The compiled extension module, with every target registered; None if it was not built."""
    try:
        from jax_megamoe import _ext
    except ModuleNotFoundError:  # a source tree without a build; any other import error is a real bug
        return None
    for name, capsule in _ext.registrations().items():
        if name not in _BY_NAME:
            raise RuntimeError(f"the extension registers {name!r}, which jax_megamoe/_targets.py does not declare")
        jax.ffi.register_ffi_target(name, capsule, platform=_BY_NAME[name].platform)
    return _ext


def has_cpu_kernels() -> bool:
    return extension() is not None


def has_cuda_kernels() -> bool:
    ext = extension()
    return ext is not None and bool(ext.with_cuda)


def _varying_axes(value) -> frozenset:
    """Mesh axes along which `value` varies inside `shard_map` (empty outside it)."""
    aval = jax.typeof(value)
    mat = getattr(aval, "mat", None)  # jax 0.10 names it manual_axis_type; older/newer releases vma
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _mark_varying(value, axes: frozenset):
    missing = tuple(sorted(axes - _varying_axes(value)))
    if not missing:
        return value
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(value, missing, to="varying")
    return jax.lax.pvary(value, missing)  # type: ignore[attr-defined]  # releases before pcast


def vary_alike(*values):
    """Marks every value varying over the union of the values' varying mesh axes (no-op outside
    `shard_map`). FFI operands must agree on it; done outside a custom_vjp, autodiff sums the
    cotangents of replicated operands (pcast's transpose) the way shard_map semantics require."""
    axes = frozenset().union(*(_varying_axes(v) for v in values))
    return tuple(_mark_varying(v, axes) for v in values)


# An identity on one operand of every FFI call whose lowering checks the platform it is lowered for: a
# target lowered for another platform fails with our message instead of XLA's "No FFI handler registered".
_platform_guard_p = Primitive("jmm_platform_guard")
_platform_guard_p.def_impl(lambda x, **_: x)
_platform_guard_p.def_abstract_eval(lambda aval, **_: aval)
batching.primitive_batchers[_platform_guard_p] = lambda args, dims, **params: (
    _platform_guard_p.bind(*args, **params),
    dims[0],
)
ad.primitive_jvps[_platform_guard_p] = lambda primals, tangents, **params: (
    _platform_guard_p.bind(*primals, **params),
    tangents[0],
)
mlir.register_lowering(_platform_guard_p, lambda ctx, x, **_: [x])

_IMPLEMENTATION_OF_PLATFORM = {"cpu": "cpu", "CUDA": "cuda"}


def _guard_lowering(lowered_for: str):
    def rule(ctx, x, *, target: str, platform: str):
        if platform.lower() != lowered_for:
            implementation = _IMPLEMENTATION_OF_PLATFORM[platform]
            raise ValueError(
                f"{target} is a kernel of implementation={implementation!r}, which runs on {platform} devices, but "
                f"the program is being compiled for {lowered_for}. jax_megamoe picks its kernels when the function "
                f"is traced (implementation='auto' follows the arrays' devices, else jax.default_backend()): pass "
                f"the implementation for {lowered_for} explicitly, or 'reference'"
            )
        return [x]

    return rule


for _platform in ("cpu", "cuda", "rocm"):
    mlir.register_lowering(_platform_guard_p, _guard_lowering(_platform), platform=_platform)


def call(target: Target, result_shapes, *operands, workspace_args: tuple = (), **attrs):
    """Calls `target` on operands made alike by `vary_alike`; returns its results (minus the workspace).

    `attrs` must be exactly the target's declared attributes. A target with a `workspace_query` gets one
    more result, last, of `_ext.<workspace_query>(*workspace_args)` bytes, dropped here. FFI results come
    back typed as invariant inside `shard_map`; each device computes its own local result, so they are
    marked varying like the operands.
    """
    ext = extension()
    if ext is None:
        raise RuntimeError("jax_megamoe's compiled extension is missing: reinstall with `pip install .`")
    if set(attrs) != set(target.attrs):
        raise TypeError(f"{target.name} takes attributes {sorted(target.attrs)}, got {sorted(attrs)}")
    shapes = tuple(result_shapes)
    if target.workspace_query is not None:
        size = int(getattr(ext, target.workspace_query)(*workspace_args))
        shapes = (*shapes, jax.ShapeDtypeStruct((size,), jnp.uint8))
    axes = frozenset().union(*(_varying_axes(a) for a in operands))
    guarded = (_platform_guard_p.bind(operands[0], target=target.name, platform=target.platform), *operands[1:])
    results = jax.ffi.ffi_call(
        target.name, shapes, vmap_method=target.vmap_method, input_output_aliases=dict(target.aliases) or None
    )(*guarded, **attrs)
    results = results[: len(result_shapes)]
    return tuple(_mark_varying(r, axes) for r in results)


def residuals(values):
    """`values` (a forward's arrays kept for its backward) behind an optimisation barrier.

    Inside a scan over layers every residual is written into a stacked buffer. Without the barrier XLA's
    GPU dynamic-slice fusion makes an FFI call whose result is a residual write that buffer itself by running
    the call a second time (its other users keep the first run: the gate/up GEMM ran twice per layer), and
    a cast feeding both an FFI call and the stack is computed twice. Behind it the stack gets a copy. One
    barrier per array, so that under `jax.checkpoint` a saved residual does not tie the others to it. The
    weights are left out: they are the forward's inputs as they came, which the layer scan
    (`jax_megamoe.models.layer_scan`) recognises and slices again in the backward instead of stacking them.
    """
    return jax.tree.map(jax.lax.optimization_barrier, values)
