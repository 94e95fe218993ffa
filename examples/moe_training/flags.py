"""What the command-line jobs share (examples/train_qwen3_moe.py, examples/rl_qwen3_moe.py): the flags of the model
and its kernels and of the devices, their checks, what is set before JAX starts, the presets' model configs, and
the mesh's shape; the check of a model directory (also examples/generate_qwen3_moe.py's). Nothing here imports JAX
at module level: the jobs parse their flags before JAX starts."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os

from jax_megamoe import cli

# The share of each GPU's memory JAX's allocator may use (its own default is 0.75): above the memory plan's default
# budget (90% of an H200's memory), so a step the plan says fits is not refused memory by JAX's smaller share.
GPU_MEMORY_FRACTION = "0.92"
# A model directory's weights: one file or the index of its shards (jax_megamoe.models.hf_checkpoint's names).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def job_parser(description: str, presets, preset_help: str) -> tuple[cli.Parser, argparse._ArgumentGroup]:
    """A job's parser (the shared help formatter) and its "model" group, which starts with `--preset` (one of
    `presets`, default tiny)."""
    parser = cli.Parser(description=description, formatter_class=HelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--preset", choices=sorted(presets), default="tiny", help=preset_help)
    return parser, model


class HelpFormatter(argparse.HelpFormatter):
    """States each flag's default once: argparse's own default for flags that have one, the presets' values
    for flags the preset fills in (their help says so), nothing for flags without a default."""

    def _get_help_string(self, action):
        text = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not hidden and "%(default)" not in text:  # by identity: a default of 0 or 0.0 is stated too
            text += " (default: %(default)s)"
        return text


def add_model_arguments(model) -> None:
    """The model's flags after `--preset` (which each job defines with its presets), into the group `model`."""
    model.add_argument("--layers", type=int, help="override the preset's number of decoder layers")
    model.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one scan per run of same-kind layers (compile time independent of depth); --no-scan-layers unrolls them",
    )
    model.add_argument(
        "--implementation",
        choices=["auto", "cpu", "cuda", "reference", "ragged_dot"],
        default="auto",
        help="MoE expert kernels; ragged_dot is the pure-JAX sort + jax.lax.ragged_dot baseline",
    )
    model.add_argument(
        "--transport",
        choices=["xla", "ragged", "nvlink"],
        default="xla",
        help="expert-parallel transport (moe_ffn_ep) when the expert axis spans devices; nvlink "
        "(GPUs of one host) opens one NvlinkWorkspace for the run",
    )
    model.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    model.add_argument(
        "--param-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="storage dtype of the parameters and of AdamW's moments (float32: master weights)",
    )
    model.add_argument(
        "--recipe",
        choices=["fp8_blockwise"],
        default=None,
        help="moe_ffn's recipe: fp8_blockwise runs the experts' GEMMs on e4m3 operands with blockwise scales "
        "(needs --dtype bfloat16; see docs/fp8.md)",
    )
    model.add_argument("--remat", action="store_true", help="recompute each layer in the backward pass")
    model.add_argument(
        "--remat-save-moe",
        action="store_true",
        help="with --remat, keep the experts' gate/up projections instead of recomputing them",
    )
    model.add_argument(
        "--attention-impl",
        choices=["xla", "cudnn", "chunked"],
        default=None,
        help="jax.nn.dot_product_attention implementation, or chunked (pure JAX over query blocks, "
        "memory linear in the sequence length) (default: JAX's choice; with the training job's --dry-run on CPU: "
        "chunked, standing in for cuDNN's flash attention)",
    )


def add_device_arguments(mesh) -> None:
    """The mesh's and the processes' flags, into the group `mesh`."""
    mesh.add_argument("--mesh-data", type=int, help="data-parallel mesh size (default: devices / expert size)")
    mesh.add_argument(
        "--mesh-expert",
        type=int,
        help="expert-parallel mesh size (default: the largest divisor of the device count and "
        "the expert count that leaves data parallelism >= 2 where possible)",
    )
    mesh.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the parameters and optimizer state over the data axis as well (FSDP; each layer "
        "gathered inside the step); default: only the experts are sharded, over expert",
    )
    mesh.add_argument(
        "--fsdp-over-expert",
        action="store_true",
        help="with --fsdp, shard the non-expert matrices over every device (data x expert), not data "
        "alone: less memory for more gather traffic over the expert axis (inside a host)",
    )
    mesh.add_argument(
        "--host-devices",
        type=int,
        default=8,
        help="CPU devices to emulate when JAX runs on the host (sets XLA_FLAGS before JAX starts)",
    )
    mesh.add_argument(
        "--coordinator-address",
        help="jax.distributed coordinator host:port for a manual "
        "multi-process launch (also JAX_COORDINATOR_ADDRESS), with --num-processes and --process-id",
    )
    mesh.add_argument("--num-processes", type=int, help="processes of a manual multi-process launch")
    mesh.add_argument("--process-id", type=int, help="this process's index in a manual multi-process launch")


def check_arguments(
    parser: argparse.ArgumentParser, args, positive: tuple[str, ...], non_negative: tuple[str, ...] = ()
) -> None:
    """The checks of the shared flags, and that each flag named (by destination) in `positive` is > 0 (an integer
    one >= 1) and each in `non_negative` >= 0, a float one finite, where given; errors go through `parser.error`
    (a usage error)."""
    shared = ("layers", "host_devices", "num_processes", "mesh_data", "mesh_expert")
    checks = [(name, False) for name in positive + shared] + [(name, True) for name in non_negative]
    for name, zero_allowed in checks:
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            parser.error(f"{flag} must be a finite number, got {value}")
        if not (value >= 0 if zero_allowed else value > 0):
            bound = ">= 0" if zero_allowed else ">= 1" if isinstance(value, int) else "> 0"
            parser.error(f"{flag} must be {bound}, got {value}")
    if args.remat_save_moe and not args.remat:
        parser.error("--remat-save-moe needs --remat")
    if args.fsdp_over_expert and not args.fsdp:
        parser.error("--fsdp-over-expert needs --fsdp")
    if args.recipe and args.dtype != "bfloat16":
        parser.error(f"--recipe {args.recipe} needs --dtype bfloat16")
    if args.recipe and args.implementation == "ragged_dot":
        parser.error(f"--recipe {args.recipe} runs on moe_ffn's kernels: --implementation auto, cuda, cpu or reference")
    manual = (args.num_processes, args.process_id)
    if any(v is not None for v in manual) and None in manual:
        parser.error("--num-processes and --process-id go together")
    if args.process_id is not None and not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id must be in [0, --num-processes), got {args.process_id}")


def model_dir_problem(model_dir: str) -> str | None:
    """What keeps `model_dir` from being a model directory (save_pretrained's layout: config.json and safetensors
    weights), as "no ... in DIR"; None where nothing does."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return f"no config.json in {model_dir}"
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in WEIGHT_FILES):
        return f"no weights ({' or '.join(WEIGHT_FILES)}) in {model_dir}"
    return None


def configure_jax_environment(host_devices: int) -> None:
    """Before JAX starts: gives the host platform `host_devices` devices, so a CPU-only machine still gets a data x
    expert mesh (the flag only concerns the CPU platform), and lets JAX's GPU allocator use GPU_MEMORY_FRACTION of
    each GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={host_devices}".strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)


def multi_process_launch(args) -> bool:
    """Whether this process is one of several that must join one JAX job (launched by hand with
    --num-processes, or by SLURM / Open MPI / a JAX_COORDINATOR_ADDRESS environment)."""
    counts = (os.environ.get("SLURM_NTASKS"), os.environ.get("OMPI_COMM_WORLD_SIZE"))
    return (
        args.num_processes is not None
        or bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
        or any(c and int(c) > 1 for c in counts)
    )


def start_jax(args):
    """Sets the environment JAX reads, starts it (joining the other processes of a multi-process launch) and
    returns the `jax` module."""
    configure_jax_environment(args.host_devices)
    import jax

    if multi_process_launch(args):
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    return jax


def model_config(preset: str, layers: int | None = None):
    """The model config of a preset: tiny, qwen3-30b-a3b-4layer (Qwen3-30B-A3B's widths, 4 layers), qwen3-30b-a3b,
    qwen3-235b-a22b; `layers` overrides the depth."""
    from jax_megamoe.models import qwen3_moe

    config = {
        "tiny": qwen3_moe.tiny,
        "qwen3-30b-a3b-4layer": qwen3_moe.qwen3_30b_a3b,
        "qwen3-30b-a3b": qwen3_moe.qwen3_30b_a3b,
        "qwen3-235b-a22b": qwen3_moe.qwen3_235b_a22b,
    }[preset]()
    if preset == "qwen3-30b-a3b-4layer":
        config = dataclasses.replace(config, num_hidden_layers=4)
    return dataclasses.replace(config, num_hidden_layers=layers) if layers else config


def choose_mesh(args, num_devices: int, num_experts: int) -> None:
    """Fills in --mesh-data / --mesh-expert and checks them against the devices, the experts and the
    implementation."""
    if args.mesh_expert is None:
        if args.mesh_data is not None:
            args.mesh_expert = num_devices // args.mesh_data
        else:
            fits = [d for d in range(1, num_devices + 1) if num_devices % d == 0 and num_experts % d == 0]
            args.mesh_expert = max([d for d in fits if num_devices // d >= 2] or fits)
    if args.mesh_data is None:
        args.mesh_data = num_devices // args.mesh_expert
    if args.mesh_data * args.mesh_expert != num_devices:
        raise cli.UsageError(
            f"--mesh-data {args.mesh_data} x --mesh-expert {args.mesh_expert} must use all {num_devices} devices"
        )
    if num_experts % args.mesh_expert:
        raise cli.UsageError(f"--mesh-expert {args.mesh_expert} must divide the {num_experts} experts")
    if args.implementation == "ragged_dot" and args.mesh_expert > 1:
        raise cli.UsageError("--implementation ragged_dot computes the experts of one device: use --mesh-expert 1")
