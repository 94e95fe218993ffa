"""The train state, the optimizer, the sharded LM cross-entropy, and the jitted, donated optimizer step of any loss.

A state is `TrainState(params, opt_state)`. It is built from a model's constructor, shapes first
(`abstract_state`), so that its shardings (`jax_megamoe.models.sharding.tree_shardings`) are known before any array
exists and every array is then born in its shards (`init_state`) or read into them (`Checkpoints.restore`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_megamoe.losses import linear_cross_entropy
from jax_megamoe.models import sharding

BATCH_AXES = ("data", "expert")  # a batch is split over the whole mesh; the experts over "expert"

# `loss_fn(params, batch) -> (loss, stats)`: a scalar loss and a dict of scalar statistics.
LossFn = Callable[[nnx.State, Any], tuple[jax.Array, dict[str, jax.Array]]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """A model's parameters (`nnx.State`) and their optimizer's state."""

    params: nnx.State
    opt_state: optax.OptState

    @classmethod
    def create(cls, params: nnx.State, tx: optax.GradientTransformation, opt_shardings: Any = None) -> TrainState:
        """`params` with a fresh state of the optimizer `tx`, born in `opt_shardings` (None: JAX's placement)."""
        return cls(params, jax.jit(tx.init, out_shardings=opt_shardings)(params))


def make_mesh(data: int, expert: int) -> jax.sharding.Mesh:
    """A `data` x `expert` mesh over all devices (Auto axes: jit propagates the shardings)."""
    return jax.make_mesh((data, expert), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """A batch's rows split over every axis of `mesh` (`BATCH_AXES`), as the MoE layers split the tokens."""
    return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(rows: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The host array `rows` (the same on every process) as one global array in `sharding`; each process supplies
    only its own devices' shards."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def adamw(
    learning_rate: float,
    *,
    warmup_steps: int,
    decay_steps: int,
    weight_decay: float,
    grad_clip: float,
    b1: float = 0.9,
    b2: float = 0.95,
    final_fraction: float = 0.1,
) -> optax.GradientTransformation:
    """AdamW after clipping the gradients' global norm to `grad_clip`; the learning rate rises linearly from 0 over
    `warmup_steps`, then decays along a cosine to `final_fraction * learning_rate` at step `decay_steps`. Weight
    decay applies to matrices only (a scanned stack's leading layer axis does not make a norm scale a matrix)."""
    names = ("learning_rate", "warmup_steps", "decay_steps", "weight_decay", "grad_clip")
    for name, value in zip(names, (learning_rate, warmup_steps, decay_steps, weight_decay, grad_clip), strict=True):
        if not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps, max(decay_steps, warmup_steps + 1), end_value=learning_rate * final_fraction
    )

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, p: p.ndim - (sharding.STACKED in sharding.path_names(path)) >= 2, params
        )

    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
    )


def abstract_state(
    create: Callable[[], nnx.Module], tx: optax.GradientTransformation
) -> tuple[nnx.GraphDef, TrainState]:
    """`(graphdef, state)` of the model `create()` builds and its optimizer `tx`, the state as
    `jax.ShapeDtypeStruct`s: shapes only, nothing allocated. `nnx.merge(graphdef, state.params)` is the model."""
    graphdef, params = nnx.split(nnx.eval_shape(create))
    return graphdef, TrainState(params, jax.eval_shape(tx.init, params))


def init_state(
    create: Callable[[], nnx.Module], tx: optax.GradientTransformation, shardings: TrainState | None = None
) -> TrainState:
    """The model's parameters and `tx`'s state, each array born in its sharding in `shardings` (from
    `jax_megamoe.models.sharding.tree_shardings` of `abstract_state`'s state; None: JAX's default placement). Call
    it outside `jax.set_mesh`, so that no layer constrains its own parameters on the way."""
    params = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings and shardings.params)()
    return TrainState.create(params, tx, shardings and shardings.opt_state)


def cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    labels: jax.Array,
    mesh: jax.sharding.Mesh | None = None,
    *,
    batch_axes: tuple[str, ...] = BATCH_AXES,
) -> jax.Array:
    """Mean cross-entropy of the logits `hidden [B, S, H] @ kernel [H, V]` against `labels [B, S]`, never forming
    the `[B, S, V]` logits (`jax_megamoe.losses.linear_cross_entropy`). Under a `mesh` of several devices each device
    takes its own rows (`shard_map` over `batch_axes`) with the whole LM head, and the sums meet in one psum."""
    count = labels.size

    def local_sum(hidden, kernel, labels):
        return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), kernel, labels.reshape(-1), reduction="sum")

    if mesh is None or mesh.size == 1:
        return local_sum(hidden, kernel, labels) / count

    def shard_sum(hidden, kernel, labels):
        return jax.lax.psum(local_sum(hidden, kernel, labels), batch_axes)

    rows = P(batch_axes)
    # check_vma=False: linear_cross_entropy's scan starts its sums from fresh (device-invariant) zeros; the
    # transpose then psums the LM head's gradient over the mesh, as an unmapped input's must be.
    total = jax.shard_map(shard_sum, mesh=mesh, in_specs=(rows, P(), rows), out_specs=P(), check_vma=False)(
        hidden, kernel, labels
    )
    return total / count


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    state_shardings: TrainState | None = None,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted optimizer step of `loss_fn(params, batch) -> (loss, stats)`: `(state, batch) -> (new state,
    {"loss", **stats, "grad_norm"})`. The state is donated (its buffers hold the new state); with `state_shardings`
    and `batch_sharding` the state keeps its shardings from step to step, so one compilation serves a run."""

    def train_step(state: TrainState, batch):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        stats = {"loss": loss, **stats, "grad_norm": optax.tree.norm(grads)}
        return TrainState(optax.apply_updates(state.params, updates), opt_state), stats

    if state_shardings is None and batch_sharding is None:
        return jax.jit(train_step, donate_argnums=0)
    return jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )
