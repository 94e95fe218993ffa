"""Orbax checkpoints of a training state, and resuming, which first checks that a checkpoint holds the state asked
for (shapes and dtypes only, nothing read) and otherwise refuses it with a `CheckpointMismatch` (a `ValueError`)
naming the first differing array and both its shapes or dtypes.

    checkpoints = Checkpoints("ckpt/", save_every=100)
    step = checkpoints.latest_step() or 0
    state = checkpoints.restore(step, abstract, shardings) if step else init_state(create, tx, shardings)
    for step in range(step + 1, steps + 1):
        state, stats = train_step(state, batch)
        checkpoints.save(step, state, force=step == steps)
    checkpoints.wait_until_finished()
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jax_megamoe.models.sharding import path_names

# A pytree path as plain names -> (shape, dtype name): what a checkpoint's metadata and a state's shapes are
# compared by.
ArraySpecs = dict[tuple[str, ...], tuple[tuple[int, ...], str]]


def array_specs(tree: Any) -> ArraySpecs:
    """`{path: (shape, dtype name)}` of every array of `tree` (a state, its `jax.ShapeDtypeStruct`s, or a
    checkpoint's metadata), the paths as names (`("params", "embed_tokens", "embedding")`)."""
    return {
        tuple(str(name) for name in path_names(path)): (tuple(leaf.shape), str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


class CheckpointMismatch(ValueError):
    """A checkpoint that does not hold the state asked for. `name`: the first differing array (its path joined by
    dots, without the leading `params`; parameters come before the optimizer's state); `stored`, `wanted`: its
    `(shape, dtype name)` in the checkpoint and in the state asked for (None where absent); `stored_specs`,
    `wanted_specs`: every array of both (`array_specs`), for a caller that tells its user which setting wrote the
    checkpoint."""

    def __init__(
        self,
        step: int,
        directory: str,
        path: tuple[str, ...],
        stored_specs: ArraySpecs,
        wanted_specs: ArraySpecs,
    ):
        self.step, self.directory, self.path = step, directory, path
        self.name = ".".join(path[1:] if path[0] == "params" else path)
        self.stored, self.wanted = stored_specs.get(path), wanted_specs.get(path)
        self.stored_specs, self.wanted_specs = stored_specs, wanted_specs
        super().__init__(
            f"the checkpoint of step {step} in {directory} does not hold the state asked for: "
            f"{self.difference('the state')}"
        )

    @property
    def dtype_only(self) -> bool:
        """Whether the array is in both with the same shape, so that only its dtype differs."""
        return self.stored is not None and self.wanted is not None and self.stored[0] == self.wanted[0]

    def difference(self, asker: str) -> str:
        """`"NAME is stored as float32, ASKER asks for bfloat16"`, or with shapes (`absent` where missing) where
        they differ."""
        if self.dtype_only:
            assert self.stored is not None and self.wanted is not None
            return f"{self.name} is stored as {self.stored[1]}, {asker} asks for {self.wanted[1]}"
        stored, wanted = (spec[0] if spec is not None else "absent" for spec in (self.stored, self.wanted))
        return f"{self.name} is stored {stored}, {asker} asks for {wanted}"


def first_difference(stored: ArraySpecs, wanted: ArraySpecs) -> tuple[str, ...] | None:
    """The path of the first array whose shape or dtype differs between two `array_specs` (or that only one
    holds), the parameters' paths first; None where they agree."""
    paths = sorted(stored.keys() | wanted.keys(), key=lambda path: (path[0] != "params", path))
    return next((path for path in paths if stored.get(path) != wanted.get(path)), None)


class Checkpoints:
    """Orbax checkpoints of a state (any pytree of arrays, e.g. a `TrainState`) in `directory`, one every
    `save_every` steps, keeping the last `keep`. The directory is created by the first save, not before, so that
    looking for a checkpoint to resume creates nothing."""

    def __init__(self, directory: str | os.PathLike[str], *, save_every: int = 1, keep: int = 2):
        if save_every < 1 or keep < 1:
            raise ValueError(f"save_every and keep must be >= 1, got save_every={save_every}, keep={keep}")
        self.directory = os.path.abspath(directory)
        self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every)
        self._manager: ocp.CheckpointManager | None = None

    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = ocp.CheckpointManager(
                self.directory, options=self._options, item_handlers=ocp.StandardCheckpointHandler()
            )
        return self._manager

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint, None where there is none (or no directory)."""
        if self._manager is None and not os.path.isdir(self.directory):
            return None
        return self._open().latest_step()

    def check(self, step: int, abstract: Any) -> None:
        """Raises `CheckpointMismatch` unless the checkpoint of `step` holds arrays of the shapes and dtypes of
        `abstract` (the state asked for, e.g. `abstract_state`'s), at the same paths."""
        stored, wanted = array_specs(self._open().item_metadata(step)), array_specs(abstract)
        path = first_difference(stored, wanted)
        if path is not None:
            raise CheckpointMismatch(step, self.directory, path, stored, wanted)

    def restore(self, step: int, abstract: Any, shardings: Any = None) -> Any:
        """The state saved at `step`, after `check`: each array read straight into its sharding in `shardings` (a
        tree like `abstract`'s; None: `abstract`'s own, or JAX's default placement)."""
        self.check(step, abstract)
        if shardings is not None:
            abstract = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
            )
        return self._open().restore(step, args=ocp.args.StandardRestore(abstract))

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Saves `state` as step `step` if `save_every` divides it, or `force`; returns whether it did. The write
        goes on in the background (`wait_until_finished`)."""
        return self._open().save(step, args=ocp.args.StandardSave(state), force=force)

    def wait_until_finished(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None
