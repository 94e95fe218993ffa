"""Train a Qwen3-MoE language model with jax_megamoe's MoE kernels on a `data` x `expert` device mesh.

With no arguments it trains a tiny byte-level model on the Python standard library's sources, on the GPU
when there is one, else on 8 host CPU devices (a 2 x 4 mesh), in a few minutes:

    python examples/train_qwen3_moe.py
    python examples/train_qwen3_moe.py --preset qwen3-30b-a3b-4layer --batch 4 --seq 4096   # one H200

The real models at full depth, FSDP over `data`, experts over `expert`; `--dry-run` prints the per-device
memory plan from XLA's memory analysis of the compiled step without allocating anything (on a CPU-only
machine host devices stand in for the GPUs and the figures are estimates):

    python examples/train_qwen3_moe.py --preset qwen3-30b-a3b --mesh-expert 8 --fsdp --remat --remat-save-moe \
        --dry-run --host-devices 8

Writes metrics.jsonl, loss_curve.png and summary.json to --out-dir; --ckpt-dir/--resume checkpoint with
orbax. Under SLURM / Open MPI / JAX_COORDINATOR_ADDRESS it calls `jax.distributed.initialize()` first.
`--help` lists every flag. A command line that cannot run exits with status 2, a run that fails with 1
(moe_training/cli.py). Docs: docs/models.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_training import cli  # noqa: E402  (the example's helpers; path set above; JAX is imported later)

PRESETS = {  # name -> training defaults; the model configs are built after JAX starts (model_config)
    "tiny": dict(batch=16, seq=128, steps=300, lr=3e-3, warmup=20, eval_every=50, eval_batches=4, save_model=True),
    "qwen3-30b-a3b-4layer": dict(
        batch=4, seq=4096, steps=300, lr=3e-4, warmup=30, eval_every=100, eval_batches=2, save_model=True
    ),
    # The published models at full depth; batch None: 4 sequences per device (16,384 tokens at seq 4096). Their
    # final model (61 GB and 470 GB in bf16) is saved only on request.
    "qwen3-30b-a3b": dict(
        batch=None, seq=4096, steps=1000, lr=3e-4, warmup=100, eval_every=200, eval_batches=2, save_model=False
    ),
    "qwen3-235b-a22b": dict(
        batch=None, seq=4096, steps=1000, lr=1.5e-4, warmup=100, eval_every=200, eval_batches=2, save_model=False
    ),
}
SEQUENCES_PER_DEVICE = 4  # the full-depth presets' batch: this many sequences per device


class _HelpFormatter(argparse.HelpFormatter):
    """States each flag's default once: argparse's own default for flags that have one, the presets' values
    for flags the preset fills in (their help says so), nothing for flags without a default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _preset_default(key: str) -> str:
    values = ", ".join(
        f"{name} {preset[key] if preset[key] is not None else f'{SEQUENCES_PER_DEVICE} per device'}"
        for name, preset in PRESETS.items()
    )
    return "default from --preset: " + values


def parse_args(argv=None) -> argparse.Namespace:
    parser = cli.Parser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="tiny: byte-level 2-layer model; qwen3-30b-a3b-4layer: Qwen3-30B-A3B widths, 4 layers; "
        "qwen3-30b-a3b, qwen3-235b-a22b: the published models, full depth",
    )
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
        "memory linear in --seq) (default: JAX's choice; with --dry-run on CPU: chunked, "
        "standing in for cuDNN's flash attention)",
    )
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, help="total optimizer steps; " + _preset_default("steps"))
    run.add_argument("--batch", type=int, help="global batch size in sequences; " + _preset_default("batch"))
    run.add_argument("--seq", type=int, help="sequence length in tokens; " + _preset_default("seq"))
    run.add_argument("--lr", type=float, help="peak learning rate; " + _preset_default("lr"))
    run.add_argument("--warmup", type=int, help="linear warm-up steps; " + _preset_default("warmup"))
    run.add_argument("--lr-decay-steps", type=int, help="cosine decay horizon (default: --steps)")
    run.add_argument("--weight-decay", type=float, default=0.1)
    run.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    run.add_argument(
        "--aux-loss-coef", type=float, help="load-balancing loss weight (default: the config's router_aux_loss_coef)"
    )
    run.add_argument("--z-loss-coef", type=float, default=0.0, help="router z-loss weight")
    run.add_argument("--seed", type=int, default=0)
    mesh = parser.add_argument_group("devices")
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
    mesh.add_argument("--peak-tflops", type=float, help="per-device peak for MFU (default: known for H200)")
    io = parser.add_argument_group("data and outputs")
    io.add_argument("--data", help="token file (.npy, or raw .bin of --bin-dtype); default: stdlib bytes")
    io.add_argument("--bin-dtype", default="uint16", help="dtype of a raw .bin token file")
    io.add_argument("--corpus-bytes", type=int, default=8 << 20, help="bytes of stdlib source to train on")
    io.add_argument(
        "--eval-every", type=int, help="steps between eval-loss measurements; " + _preset_default("eval_every")
    )
    io.add_argument("--eval-batches", type=int, help="held-out batches per eval; " + _preset_default("eval_batches"))
    io.add_argument("--out-dir", default="runs/train_qwen3_moe", help="metrics.jsonl, loss_curve.png, summary.json")
    io.add_argument("--ckpt-dir", help="orbax checkpoint directory (no checkpoints without it)")
    io.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints (the last always)")
    io.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    io.add_argument(
        "--save-model",
        action=argparse.BooleanOptionalAction,
        help="write the final model to OUT_DIR/model in Hugging Face's layout (bf16 safetensors), which "
        "examples/generate_qwen3_moe.py and transformers read; " + _preset_default("save_model"),
    )
    plan = parser.add_argument_group("memory plan")
    plan.add_argument(
        "--dry-run",
        action="store_true",
        help="compile the train step for the mesh and preset, print XLA's per-device memory analysis "
        "(estimates on host CPU devices) and exit; allocates nothing. Also written to "
        "--out-dir/memory_plan.json",
    )
    plan.add_argument(
        "--memory-budget-gb",
        type=float,
        default=0.9 * 141,
        help="per-device memory the plan must fit in, GB (default: 90%% of an H200's 141 GB)",
    )
    args = parser.parse_args(argv)

    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lr_decay_steps = args.lr_decay_steps or args.steps
    for name in (
        "steps",
        "batch",
        "seq",
        "eval_every",
        "eval_batches",
        "ckpt_every",
        "host_devices",
        "lr_decay_steps",
        "layers",
        "num_processes",
    ):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("mesh_data", "mesh_expert"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.data and not os.path.isfile(args.data):
        parser.error(f"--data: no such file: {args.data}")
    if args.resume and not args.ckpt_dir:
        parser.error("--resume needs --ckpt-dir")
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
    return args


# The share of each GPU's memory JAX's allocator may use (its own default is 0.75): the memory plan's default budget
# is 90% of an H200's 141 GB, and a 10-layer 30B-width step planned at 118.6 GB ran out of memory at 0.75.
GPU_MEMORY_FRACTION = "0.92"


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


def model_config(preset: str, layers: int | None = None):
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
    """Fills in --mesh-data / --mesh-expert (and a per-device preset batch) and checks them against the
    devices, experts and batch."""
    if args.batch is None:
        args.batch = SEQUENCES_PER_DEVICE * num_devices
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
    if args.batch % num_devices:
        raise cli.UsageError(f"--batch {args.batch} must be divisible by the {num_devices} devices of the mesh")
    if args.implementation == "ragged_dot" and args.mesh_expert > 1:
        raise cli.UsageError("--implementation ragged_dot computes the experts of one device: use --mesh-expert 1")


def main(argv=None) -> None:
    args = parse_args(argv)
    configure_jax_environment(args.host_devices)
    import jax  # after XLA_FLAGS is set

    if multi_process_launch(args):
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    from moe_training import data, trainer

    config = model_config(args.preset, args.layers)
    if args.seq > config.max_position_embeddings:
        raise cli.UsageError(
            f"--seq {args.seq} exceeds the model's max_position_embeddings {config.max_position_embeddings}: pass "
            f"--seq {config.max_position_embeddings} or less"
        )
    choose_mesh(args, jax.device_count(), config.num_experts)
    trainer.check_platform(args)
    if args.aux_loss_coef is None:
        args.aux_loss_coef = config.router_aux_loss_coef
    if args.dry_run:
        if args.attention_impl is None and jax.default_backend() == "cpu":
            args.attention_impl = "chunked"  # XLA:CPU's attention holds [S, S] scores; GPUs run flash attention
        plan = trainer.memory_plan(args, config)
        if jax.process_index() == 0:
            os.makedirs(args.out_dir, exist_ok=True)
            with open(os.path.join(args.out_dir, "memory_plan.json"), "w") as f:
                json.dump(plan, f, indent=2)
            print(trainer.format_memory_plan(plan), flush=True)
        return
    if args.data:
        try:
            tokens = data.load_token_file(args.data, args.bin_dtype)
        except ValueError as error:
            raise cli.UsageError(f"--data: {error}") from None
        if int(tokens.max()) >= config.vocab_size:
            raise cli.UsageError(
                f"--data holds token id {int(tokens.max())} >= the model's vocab_size {config.vocab_size}: pass a "
                "token file of the model's vocabulary"
            )
    else:
        tokens = data.stdlib_corpus(args.corpus_bytes)
    try:
        train_tokens, eval_tokens = data.split(tokens, 0.05, args.seq)
    except ValueError as error:
        raise cli.UsageError(f"--seq {args.seq}: {error}: pass a shorter --seq or more tokens") from None
    summary = trainer.train(args, config, train_tokens, eval_tokens)
    if summary:
        speed = summary["tokens_per_s"]
        print(
            f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (mean of the last steps; eval "
            f"{summary['final_eval_loss']:.3f}); {f'{speed:,.0f}' if speed else 'n/a'} tokens/s; outputs in "
            f"{args.out_dir}"
        )


if __name__ == "__main__":
    cli.run(main)
