"""The model, its optimizer and its workspace as the jobs' flags describe them (both the training job and the RL job
build them here): the platform check, the NVLink workspace, the model's options and abstract state, AdamW from the
flags, the MoE implementation that runs, and the final model's save with the command that samples from it."""

from __future__ import annotations

import os
import shlex
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from jax_megamoe import NvlinkTransport, NvlinkWorkspace, cli, training
from jax_megamoe.baselines import ragged_dot_moe_ffn
from jax_megamoe.models import qwen3_moe, sharding
from jax_megamoe.models.qwen3_moe import Qwen3MoeForCausalLM
from jax_megamoe.ops.moe import GATE_UP_NAME, LAYOUT_NAME, resolve_implementation
from jax_megamoe.parallel.transport import resolve_transport

MODEL_DIR = "model"  # the final model's directory under --out-dir
GENERATE_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "generate_qwen3_moe.py")


def check_platform(args) -> None:
    """`--implementation` and `--transport ragged` against the devices JAX found, before anything is built: a
    flag that cannot run here is a command-line error (`--transport nvlink`: when its workspace opens)."""
    try:
        implementation_label(args)
    except ValueError as error:
        raise cli.UsageError(f"--implementation {args.implementation}: {error}") from None
    if args.transport == "ragged":
        try:
            resolve_transport("ragged").check(args.mesh_expert)
        except ValueError as error:
            raise cli.UsageError(f"--transport ragged: {error}") from None


def open_workspace(args, config, mesh, tokens: int) -> NvlinkWorkspace | None:
    """The `NvlinkWorkspace` of `--transport nvlink` (None for the other transports), sized for the model's largest
    call: `tokens` input tokens split over every device of the mesh. Without GPUs or the CUDA kernels this is a
    command-line error, before anything is compiled."""
    if args.transport != "nvlink":
        return None
    try:
        return NvlinkWorkspace(
            mesh,
            "expert",
            max_tokens=tokens // mesh.size,
            hidden=config.hidden_size,
            top_k=config.num_experts_per_tok,
            dtype=jnp.dtype(args.dtype),
        )
    except ValueError as error:
        raise cli.UsageError(f"--transport nvlink: {error}") from None


def remat_policy(args):
    """`--remat-save-moe`: save moe_ffn's named residuals, so the recomputed layers skip the experts' forward."""
    return jax.checkpoint_policies.save_only_these_names(LAYOUT_NAME, GATE_UP_NAME) if args.remat_save_moe else None


def model_options(args, workspace: NvlinkWorkspace | None = None) -> dict:
    """The model's keyword arguments for the model flags (`workspace`: the nvlink transport's), the same for a
    fresh model and for `qwen3_moe.from_pretrained`."""
    implementation = ragged_dot_moe_ffn if args.implementation == "ragged_dot" else args.implementation
    return dict(
        dtype=jnp.dtype(args.dtype),
        param_dtype=jnp.dtype(args.param_dtype),
        implementation=implementation,
        expert_axis=None if callable(implementation) else "expert",  # the baseline runs per data shard
        transport=NvlinkTransport(workspace) if workspace is not None else args.transport,
        recipe=args.recipe,
        remat=args.remat,
        remat_policy=remat_policy(args),
        attention_impl=args.attention_impl,
        scan_layers=args.scan_layers,
    )


def create_model_fn(config, args, workspace: NvlinkWorkspace | None = None):
    """The model's constructor for `--preset` and the model flags (`workspace`: the nvlink transport's)."""
    options = model_options(args, workspace)

    def create():
        return Qwen3MoeForCausalLM(config, **options, rngs=nnx.Rngs(args.seed))

    return create, options["expert_axis"]


def abstract_state(config, args, mesh, tx, workspace: NvlinkWorkspace | None = None):
    """`(graphdef, create, abstract TrainState, its shardings)`: shapes only, nothing allocated. The shardings
    are `jax_megamoe.models.sharding`'s rules (FSDP over `data` with `--fsdp`) for the parameters and,
    through the same names, for AdamW's moments."""
    create, expert_axis = create_model_fn(config, args, workspace)
    graphdef, state = training.abstract_state(create, tx)
    shardings = sharding.tree_shardings(
        state, mesh, fsdp=args.fsdp, expert_axis=expert_axis, fsdp_over_expert=args.fsdp_over_expert
    )
    return graphdef, create, state, shardings


def adamw(args, lr: float, warmup: int, decay_steps: int):
    """`training.adamw` with `lr`, its schedule and the flags' weight decay and clip."""
    return training.adamw(
        lr, warmup_steps=warmup, decay_steps=decay_steps, weight_decay=args.weight_decay, grad_clip=args.grad_clip
    )


def implementation_label(args) -> str:
    """The MoE implementation that actually runs (`auto` resolved)."""
    if args.implementation == "ragged_dot":
        return "ragged_dot baseline"
    return resolve_implementation(args.implementation)


def save_model(graphdef, params, path: str) -> None:
    """The model in Hugging Face's layout at `path` (config.json, bf16 safetensors): what
    examples/generate_qwen3_moe.py, `qwen3_moe.from_pretrained` and transformers read."""
    qwen3_moe.save_pretrained(nnx.merge(graphdef, params), path, dtype=jnp.bfloat16)
    if jax.process_index() == 0:
        print(f"model saved to {path} (sample from it: {sample_command(path)})", flush=True)


def sample_command(path: str) -> str:
    """The command line that samples from the model at `path`: this job's Python interpreter (the one that has
    jax_megamoe; a bare `python` may not) running examples/generate_qwen3_moe.py, each path relative to the working
    directory where it lies under it."""

    def shown(file: str) -> str:
        relative = os.path.relpath(file)
        outside = relative == os.pardir or relative.startswith(os.pardir + os.sep)
        return shlex.quote(os.path.abspath(file) if outside else relative)

    return " ".join(shown(file) for file in (sys.executable, GENERATE_SCRIPT, path))
