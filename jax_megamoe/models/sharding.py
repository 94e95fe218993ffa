"""Sharding rules of the Qwen3-MoE parameters and their optimizer state on a `data` x `expert` mesh.

One rule, by parameter name and shape (docs/models.md has it as a table):

- the experts (`w_gate_up [E, H, 2I]`, `w_down [E, I, H]`) over `expert` on E;
- with FSDP, every matrix over `data` as well: the expert weights along the larger of their two other
  dimensions, the rest along their largest dimension, in both cases only where the dimension divides by the
  `data` axis size (else that matrix stays whole over `data`); with `fsdp_over_expert` the non-expert matrices
  over `data` x `expert` (every device) instead, where their dimension divides by both;
- vectors (norm scales) and scalars whole on every device;
- a scanned stack's leading layer axis never sharded (each step of the scan slices one layer).

The optimizer state follows the parameters: optax's moments sit under the same names with the same shapes,
so the rule applied to their paths gives them their parameter's sharding; step counts are scalars.
Inside the step each layer is gathered back to its compute sharding (`compute_spec`: the experts over
`expert`, the rest whole), one layer at a time (`jax_megamoe.models.compute_form`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

EXPERT_LEAVES = ("w_gate_up", "w_down")
STACKED = "layer_runs"  # the scanned model's stacks of layers: a leading layer axis


def path_names(path) -> tuple:
    """A pytree path (`jax.tree_util` keys) as plain names and indices, without the Variables' `value`."""
    names = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                names.append(getattr(key, attr))
                break
        else:
            names.append(str(key))
    return tuple(names[:-1] if names and names[-1] == "value" else names)


def _axis_size(mesh_shape, axis) -> int:
    return mesh_shape.get(axis, 1) if axis is not None else 1


def param_spec(
    names: tuple,
    shape: tuple,
    mesh_shape,
    *,
    fsdp: bool,
    data_axis: str = "data",
    expert_axis: str | None = "expert",
    fsdp_over_expert: bool = False,
) -> P:
    """The `PartitionSpec` of parameter `names` (its path, e.g. `("layer_runs", 0, "mlp", "w_gate_up")`) with
    `shape` on a mesh of `mesh_shape` (`{axis: size}`); also right for the parameter's optimizer moments, whose
    paths end with the parameter's."""
    spec: list[Any] = [None] * len(shape)
    free = list(range(len(shape)))
    if STACKED in names and free:
        free.pop(0)  # the layer axis
    if len(free) < 2:
        return P(*spec)
    experts = _axis_size(mesh_shape, expert_axis)
    is_expert = bool(names) and names[-1] in EXPERT_LEAVES
    if is_expert:
        if experts > 1 and shape[free[0]] % experts == 0:
            spec[free[0]] = expert_axis
        free.pop(0)
    if not fsdp:
        return P(*spec)
    data = _axis_size(mesh_shape, data_axis)
    both = data * experts
    if fsdp_over_expert and not is_expert and experts > 1 and any(shape[d] % both == 0 for d in free):
        spec[max((d for d in free if shape[d] % both == 0), key=lambda d: shape[d])] = (data_axis, expert_axis)
    elif data > 1 and any(shape[d] % data == 0 for d in free):
        spec[max((d for d in free if shape[d] % data == 0), key=lambda d: shape[d])] = data_axis
    return P(*spec)


def compute_spec(names: tuple, ndim: int, mesh, expert_axis: str | None) -> P:
    """The sharding a parameter is computed with: the expert weights over `expert_axis` (the `P(expert_axis)`
    that `moe_ffn_ep`'s shard_map takes), everything else whole; a scanned stack's layer axis whole too."""
    spec: list[Any] = [None] * ndim
    if names and names[-1] in EXPERT_LEAVES and expert_axis is not None and expert_axis in mesh.axis_names:
        spec[1 if STACKED in names else 0] = expert_axis
    return P(*spec)


def tree_specs(
    tree,
    mesh,
    *,
    fsdp: bool,
    data_axis: str = "data",
    expert_axis: str | None = "expert",
    fsdp_over_expert: bool = False,
):
    """`param_spec` for every array leaf of `tree` (parameters, an optimizer state, or a train state holding
    both; concrete or abstract), as a tree of `PartitionSpec`s of the same structure."""
    mesh_shape = dict(mesh.shape)

    def spec(path, leaf):
        return param_spec(
            path_names(path),
            tuple(getattr(leaf, "shape", ())),
            mesh_shape,
            fsdp=fsdp,
            data_axis=data_axis,
            expert_axis=expert_axis,
            fsdp_over_expert=fsdp_over_expert,
        )

    return jax.tree_util.tree_map_with_path(spec, tree)


def tree_shardings(tree, mesh, **kwargs):
    """`tree_specs` as `NamedSharding`s on `mesh`."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), tree_specs(tree, mesh, **kwargs), is_leaf=lambda x: isinstance(x, P)
    )
