"""The experts of each JAX stack: ours (`implementation="auto"`), or a peer's grouped matmul (tokamax's or
`jax.lax.ragged_dot`) behind moe_ffn's signature."""

from __future__ import annotations

import importlib.util
import sys


class Skip(Exception):
    """A stack that cannot run here; its message is the row's status."""


def sorted_ragged_ffn(ragged_dot):
    """A pure-JAX expert path with moe_ffn's positional signature: sort the (token, k) pairs by expert, two
    grouped matmuls `ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`, weighted scatter-add back."""
    import jax
    import jax.numpy as jnp

    def ffn(x, weights, experts, w_gate_up, w_down):
        top_k, num_experts = experts.shape[1], w_gate_up.shape[0]
        flat = experts.reshape(-1)
        valid = (flat >= 0) & (flat < num_experts)
        order = jnp.argsort(jnp.where(valid, flat, num_experts), stable=True)  # dropped pairs sort last
        token_of_row = order // top_k
        sizes = jnp.bincount(jnp.where(valid, flat, 0), weights=valid.astype(jnp.int32), length=num_experts).astype(
            jnp.int32
        )
        gate, up = jnp.split(ragged_dot(x[token_of_row], w_gate_up, sizes), 2, axis=-1)
        rows = ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)
        row_weights = jnp.where(valid, weights.reshape(-1), 0)[order].astype(jnp.float32)
        y = jnp.zeros(x.shape, jnp.float32).at[token_of_row].add(rows.astype(jnp.float32) * row_weights[:, None])
        return y.astype(x.dtype)

    return ffn


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
    modules["xprof"].cli = modules["xprof.cli"]
    modules["xprof.cli"].tools = modules["xprof.cli.tools"]

    def get_kernel_stats_tool(*args, **kwargs):
        raise RuntimeError("xprof is a stub in bench_train.py's tokamax child: no profiler-based timing")

    modules["xprof.cli.tools"].get_kernel_stats_tool = get_kernel_stats_tool
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
    if args.peer_site:
        sys.path.append(args.peer_site)
    sys.argv = sys.argv[:1]  # tokamax's absl flags parse sys.argv and refuse this child's own arguments
    row["xprof_stub"] = stub_xprof()
    try:
        import tokamax
    except Exception as err:  # any import failure means the peer is unavailable
        raise Skip(f"skipped: tokamax not importable ({err!r})") from err
    row["versions"]["tokamax"] = getattr(tokamax, "__version__", "?")
    row["implementation"] = "sort + tokamax.ragged_dot(implementation='mosaic')"
    return sorted_ragged_ffn(lambda a, b, s: tokamax.ragged_dot(a, b, s, implementation="mosaic")), jnp.bfloat16
