"""The experts of each JAX stack: ours (`implementation="auto"`), or a peer's grouped matmul (tokamax's or
`jax.lax.ragged_dot`) in `jax_megamoe.baselines.ragged_dot_moe_ffn`, behind moe_ffn's signature."""

from __future__ import annotations

import functools
import importlib.util
import sys

import benchmarks


class Skip(Exception):
    """A stack that cannot run here; its message is the row's status."""


def sorted_ragged_ffn(ragged_dot):
    """`ragged_dot_moe_ffn` (sort the (token, k) pairs by expert, two grouped matmuls, weighted scatter-add back)
    over `ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`, with moe_ffn's positional signature."""
    from jax_megamoe.baselines import ragged_dot_moe_ffn

    return functools.partial(ragged_dot_moe_ffn, ragged_dot=ragged_dot)


def stub_xprof() -> bool:
    """tokamax imports `xprof.cli.tools.get_kernel_stats_tool` for its profiler-based timing, which this
    benchmark does not use; where no xprof is installed, stub modules satisfy that import (this process only).
    Returns whether the stub was installed."""
    if importlib.util.find_spec("xprof") is not None:
        return False
    import types

    modules = {name: types.ModuleType(name) for name in ("xprof", "xprof.cli", "xprof.cli.tools")}
    for module in modules.values():
        module.__path__ = []  # packages, so that submodule imports resolve to the stubs
    setattr(modules["xprof"], "cli", modules["xprof.cli"])  # noqa: B010  (a module's attribute, set by name)
    setattr(modules["xprof.cli"], "tools", modules["xprof.cli.tools"])  # noqa: B010

    def get_kernel_stats_tool(*args, **kwargs):
        raise RuntimeError("xprof is a stub in bench_train.py's tokamax child: no profiler-based timing")

    setattr(modules["xprof.cli.tools"], "get_kernel_stats_tool", get_kernel_stats_tool)  # noqa: B010
    sys.modules.update(modules)
    return True


def expert_path(name: str, args, row: dict):
    """`(implementation for Qwen3MoeForCausalLM, param dtype)` of a JAX stack; records what it chose in `row`.
    Raises `Skip` when the stack cannot run here."""
    import jax
    import jax.numpy as jnp

    if name.startswith("ours"):
        from jax_megamoe.ops.moe import resolve_implementation

        row["implementation"] = f"auto ({resolve_implementation('auto')})"
        return "auto", jnp.dtype(args.param_dtype)
    if name == "ragged_dot":
        row["implementation"] = "sort + jax.lax.ragged_dot"
        return sorted_ragged_ffn(lambda a, b, s: jax.lax.ragged_dot(a, b, s)), jnp.bfloat16
    # tokamax
    if jax.default_backend() != "gpu":
        raise Skip(
            f"skipped: tokamax's ragged_dot kernel (Mosaic GPU) needs a GPU; platform is {jax.default_backend()}"
        )
    benchmarks.add_peer_site(args.peer_site)
    sys.argv = sys.argv[:1]  # tokamax's absl flags parse sys.argv and refuse this child's own arguments
    row["xprof_stub"] = stub_xprof()
    try:
        import tokamax
    except Exception as err:  # any import failure means the peer is unavailable
        raise Skip(f"skipped: tokamax not importable ({err!r})") from err
    row["versions"]["tokamax"] = getattr(tokamax, "__version__", "?")
    row["implementation"] = "sort + tokamax.ragged_dot(implementation='mosaic')"
    return sorted_ragged_ffn(lambda a, b, s: tokamax.ragged_dot(a, b, s, implementation="mosaic")), jnp.bfloat16
