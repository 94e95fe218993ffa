"""Loads the compiled extension and registers its XLA FFI targets, once, per platform."""

from __future__ import annotations

import functools

import jax

_PLATFORM_OF_PREFIX = {"jmm_cpu_": "cpu", "jmm_cuda_": "CUDA"}


@functools.cache
def extension():
    """The compiled extension module, with every target registered; None if it was not built."""
    try:
        from jax_megamoe import _ext
    except ModuleNotFoundError:  # a source tree without a build; any other import error is a real bug
        return None
    for name, capsule in _ext.registrations().items():
        platform = next(p for prefix, p in _PLATFORM_OF_PREFIX.items() if name.startswith(prefix))
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
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
    return jax.lax.pvary(value, missing)


def vary_alike(*values):
    """Marks every value varying over the union of the values' varying mesh axes (no-op outside
    `shard_map`). FFI operands must agree on it; done outside a custom_vjp, autodiff sums the
    cotangents of replicated operands (pcast's transpose) the way shard_map semantics require."""
    axes = frozenset().union(*(_varying_axes(v) for v in values))
    return tuple(_mark_varying(v, axes) for v in values)


def call(platform: str, op: str, result_shapes, *args, vmap_method: str = "sequential",
         input_output_aliases=None, **attrs):
    """Calls FFI target `jmm_{platform}_{op}` on operands made alike by `vary_alike`.

    `input_output_aliases` ({operand index: result index}, see `jax.ffi.ffi_call`) lets a result be written
    over an operand; XLA copies the operand first if anything else still reads it.

    Under `jax.vmap` the op runs once per batch element (`vmap_method`, see `jax.ffi.ffi_call`).

    FFI results come back typed as invariant inside `shard_map`; each device computes its own local
    result, so they are marked varying like the operands.
    """
    if extension() is None:
        raise RuntimeError("jax_megamoe's compiled extension is missing: reinstall with `pip install .`")
    axes = frozenset().union(*(_varying_axes(a) for a in args))
    results = jax.ffi.ffi_call(f"jmm_{platform}_{op}", result_shapes, vmap_method=vmap_method,
                               input_output_aliases=input_output_aliases)(*args, **attrs)
    return type(results)(_mark_varying(r, axes) for r in results)
