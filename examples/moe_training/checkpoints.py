"""The training job's orbax checkpoints (`--ckpt-dir`, `--ckpt-every`, `--resume`): the manager, and resuming, which
first checks that the checkpoint holds the state this run's flags build."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from jax_megamoe.models.sharding import STACKED, path_names
from moe_training import cli

UNSCANNED = "layers"  # the unscanned model's list of layers (STACKED: the scanned model's stacks)


def open_manager(args) -> ocp.CheckpointManager | None:
    """The manager of `--ckpt-dir` (None without it), keeping the last two checkpoints."""
    if not args.ckpt_dir:
        return None
    return ocp.CheckpointManager(
        os.path.abspath(args.ckpt_dir),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=args.ckpt_every),
        item_handlers=ocp.StandardCheckpointHandler(),
    )


def resume_step(manager: ocp.CheckpointManager | None, abstract, resume: bool) -> int:
    """The step the run continues after: with `--resume` the latest checkpoint's, once its arrays are found to be
    those of `abstract` (the state this run's flags build, shapes only); else 0, in a `--ckpt-dir` without
    checkpoints."""
    latest = manager.latest_step() if manager else None
    if not resume:
        if latest is not None:
            raise cli.UsageError(
                f"--ckpt-dir {manager.directory} already holds checkpoints up to step {latest}: pass --resume to "
                "continue, or another --ckpt-dir"
            )
        return 0
    if latest is None:
        raise cli.UsageError(f"--resume found no checkpoint in --ckpt-dir {manager.directory}")
    problem = mismatch(_shapes(manager.item_metadata(latest)), _shapes(abstract))
    if problem:
        raise cli.UsageError(
            f"--resume: the checkpoint of step {latest} in {manager.directory} does not fit this run: {problem}; "
            "or pass another --ckpt-dir to start afresh"
        )
    return latest


def restore(manager: ocp.CheckpointManager, step: int, abstract, shardings):
    """The state saved at `step`, each array read into its sharding in `shardings`."""
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    return manager.restore(step, args=ocp.args.StandardRestore(target))


def _shapes(tree) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """`{path: (shape, dtype name)}` of a state or of a checkpoint's metadata, the paths as names."""
    return {
        tuple(str(name) for name in path_names(path)): (tuple(leaf.shape), str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def mismatch(stored: dict, wanted: dict) -> str | None:
    """Where the checkpoint's arrays (`stored`, from `_shapes`) differ from those of the state the flags build
    (`wanted`): the first differing parameter, both shapes, and the flag that builds the checkpoint's state. None
    where they agree."""
    paths = sorted(stored.keys() | wanted.keys(), key=lambda path: (path[0] != "params", path))
    path = next((p for p in paths if stored.get(p) != wanted.get(p)), None)
    if path is None:
        return None
    name = ".".join(path[1:] if path[0] == "params" else path)
    if path in stored and path in wanted and stored[path][0] == wanted[path][0]:
        dtype = stored[path][1]
        return f"{name} is stored as {dtype}, this run asks for {wanted[path][1]}: resume with --param-dtype {dtype}"
    stored_shape, wanted_shape = (entry[path][0] if path in entry else "absent" for entry in (stored, wanted))
    if _layer_shapes(stored) != _layer_shapes(wanted):
        flag = "the --preset the checkpoint was written with"
    elif _scanned(stored) != _scanned(wanted):
        flag = "--scan-layers" if _scanned(stored) else "--no-scan-layers"
    else:
        flag = f"--layers {_depth(stored)}, the checkpoint's depth"
    return f"{name} is stored {stored_shape}, this run asks for {wanted_shape}: resume with {flag}"


def _layer_index(path: tuple[str, ...]) -> int | None:
    """The position of the layer index (a run of stacks, or an unscanned layer) in a parameter's path."""
    return next((i + 1 for i, name in enumerate(path[:-1]) if name in (STACKED, UNSCANNED)), None)


def _layer_shapes(shapes: dict) -> dict:
    """Each array's shape with the layer index left out of its path and a stack's layer axis out of its shape:
    what the model's widths decide, whatever the depth and scanning."""
    widths = {}
    for path, (shape, _) in shapes.items():
        i = _layer_index(path)
        if i is None:
            widths[path] = shape
        else:
            widths[path[: i - 1] + path[i + 1 :]] = shape[1:] if path[i - 1] == STACKED else shape
    return widths


def _scanned(shapes: dict) -> bool:
    return any((i := _layer_index(path)) is not None and path[i - 1] == STACKED for path in shapes)


def _depth(shapes: dict) -> int:
    """The decoder layers of a state: its stacks' leading axes summed, or its unscanned layers counted."""
    params = [(path, shape) for path, (shape, _) in shapes.items() if path[0] == "params" and len(path) > 2]
    stacks = {path[2]: shape[0] for path, shape in params if path[1] == STACKED}
    return sum(stacks.values()) if stacks else len({path[2] for path, _ in params if path[1] == UNSCANNED})
