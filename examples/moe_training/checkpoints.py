"""The jobs' checkpoints (`--ckpt-dir`, `--ckpt-every`, `--resume`) over `jax_megamoe.training.Checkpoints`, and
what `--resume` tells its user when the checkpoint holds another state than the flags build: the flag that builds
the checkpoint's."""

from __future__ import annotations

from jax_megamoe import cli, training
from jax_megamoe.models.sharding import STACKED

UNSCANNED = "layers"  # the unscanned model's list of layers (STACKED: the scanned model's stacks)


def open_checkpoints(args) -> training.Checkpoints | None:
    """The checkpoints of `--ckpt-dir` (None without it), keeping the last two."""
    return training.Checkpoints(args.ckpt_dir, save_every=args.ckpt_every, keep=2) if args.ckpt_dir else None


def resume_step(checkpoints: training.Checkpoints | None, abstract, resume: bool) -> int:
    """The step the run continues after: with `--resume` the latest checkpoint's, once its arrays are found to be
    those of `abstract` (the state this run's flags build, shapes only); else 0, in a `--ckpt-dir` without
    checkpoints."""
    if checkpoints is None:
        if resume:
            raise cli.UsageError("--resume needs --ckpt-dir")
        return 0
    latest = checkpoints.latest_step()
    if not resume:
        if latest is not None:
            raise cli.UsageError(
                f"--ckpt-dir {checkpoints.directory} already holds checkpoints up to step {latest}: pass --resume to "
                "continue, or another --ckpt-dir"
            )
        return 0
    if latest is None:
        raise cli.UsageError(f"--resume found no checkpoint in --ckpt-dir {checkpoints.directory}")
    try:
        checkpoints.check(latest, abstract)
    except training.CheckpointMismatch as error:
        raise cli.UsageError(
            f"--resume: the checkpoint of step {latest} in {checkpoints.directory} does not fit this run: "
            f"{error.difference('this run')}: resume with {flag(error)}; or pass another --ckpt-dir to start afresh"
        ) from None
    return latest


def flag(error: training.CheckpointMismatch) -> str:
    """The flag that builds the checkpoint's state, for the mismatch `error`."""
    stored, wanted = error.stored_specs, error.wanted_specs
    if error.dtype_only and error.stored:
        return f"--param-dtype {error.stored[1]}"
    if _layer_shapes(stored) != _layer_shapes(wanted):
        return "the --preset the checkpoint was written with"
    if _scanned(stored) != _scanned(wanted):
        return "--scan-layers" if _scanned(stored) else "--no-scan-layers"
    return f"--layers {_depth(stored)}, the checkpoint's depth"


def _layer_index(path: tuple[str, ...]) -> int | None:
    """The position of the layer index (a run of stacks, or an unscanned layer) in a parameter's path."""
    return next((i + 1 for i, name in enumerate(path[:-1]) if name in (STACKED, UNSCANNED)), None)


def _layer_shapes(shapes: training.ArraySpecs) -> dict:
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


def _scanned(shapes: training.ArraySpecs) -> bool:
    return any((i := _layer_index(path)) is not None and path[i - 1] == STACKED for path in shapes)


def _depth(shapes: training.ArraySpecs) -> int:
    """The decoder layers of a state: its stacks' leading axes summed, or its unscanned layers counted."""
    params = [(path, shape) for path, (shape, _) in shapes.items() if path[0] == "params" and len(path) > 2]
    stacks = {path[2]: shape[0] for path, shape in params if path[1] == STACKED}
    return sum(stacks.values()) if stacks else len({path[2] for path, _ in params if path[1] == UNSCANNED})
