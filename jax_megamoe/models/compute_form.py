"""Parameters in their compute form: matrices in the compute dtype and, under an active multi-device mesh, in
their compute sharding (`sharding.compute_spec`: the experts over the expert axis, the rest whole)."""

from __future__ import annotations

import typing

import jax
from flax import nnx

from jax_megamoe.models import sharding
from jax_megamoe.nn import active_mesh

# The parameters cast to the compute dtype: the matrices the modules would cast themselves (the router and the
# norms compute in float32 or their own dtype and are left as they are).
_MATRICES = ("kernel", "embedding", "w_gate_up", "w_down")

Tree = typing.TypeVar("Tree")


def compute_form(tree: Tree, dtype, expert_axis: str | None = None, *, gather: bool = True) -> Tree:
    """`tree` (a module, or its parameters' state) with its matrices cast to the compute dtype `dtype` and, with
    `gather` under an active multi-device mesh, constrained to `sharding.compute_spec`, which all-gathers FSDP
    shards (over `data`) where it runs: inside the model's scan, one layer at a time (again in the backward under
    remat), or once before a decode loop. Casting first gathers half the bytes in bf16. `gather=False` casts only,
    for stacks of layers and whole-model states, whose shardings stay as they are."""
    if isinstance(tree, nnx.Module):
        graphdef, state = nnx.split(tree)
        return typing.cast(Tree, nnx.merge(graphdef, compute_form(state, dtype, expert_axis, gather=gather)))
    mesh = active_mesh() if gather else None

    def convert(path, value):
        names = sharding.path_names(path)
        if names[-1] in _MATRICES and "router" not in names:
            value = value.astype(dtype)
        if mesh is not None:
            value = jax.lax.with_sharding_constraint(value, sharding.compute_spec(names, value.ndim, mesh, expert_axis))
        return value

    return jax.tree_util.tree_map_with_path(convert, tree)
