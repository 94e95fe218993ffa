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


def call(platform: str, op: str, result_shapes, *args, **attrs):
    """Calls FFI target `jmm_{platform}_{op}`."""
    if extension() is None:
        raise RuntimeError("jax_megamoe's compiled extension is missing: reinstall with `pip install .`")
    return jax.ffi.ffi_call(f"jmm_{platform}_{op}", result_shapes)(*args, **attrs)
