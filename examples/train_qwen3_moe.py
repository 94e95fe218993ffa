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
(jax_megamoe/cli.py). Docs: docs/models.md.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from jax_megamoe import cli
from moe_training import flags  # the recipes beside this script (JAX is imported later)

PRESETS: dict[str, dict[str, Any]]
PRESETS = {  # name -> training defaults; the model configs are built after JAX starts (flags.model_config)
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


def _preset_default(key: str) -> str:
    values = ", ".join(
        f"{name} {preset[key] if preset[key] is not None else f'{SEQUENCES_PER_DEVICE} per device'}"
        for name, preset in PRESETS.items()
    )
    return "default from --preset: " + values


def parse_args(argv=None) -> argparse.Namespace:
    parser, model = flags.job_parser(
        __doc__.split("\n\n")[0],
        PRESETS,
        "tiny: byte-level 2-layer model; qwen3-30b-a3b-4layer: Qwen3-30B-A3B widths, 4 layers; "
        "qwen3-30b-a3b, qwen3-235b-a22b: the published models, full depth",
    )
    flags.add_model_arguments(model)
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, help="total optimizer steps; " + _preset_default("steps"))
    run.add_argument("--batch", type=int, help="global batch size in sequences; " + _preset_default("batch"))
    run.add_argument("--seq", type=int, help="sequence length in tokens; " + _preset_default("seq"))
    run.add_argument("--lr", type=float, help="peak learning rate; " + _preset_default("lr"))
    run.add_argument("--warmup", type=int, help="linear warm-up steps; " + _preset_default("warmup"))
    run.add_argument("--lr-decay-steps", type=int, help="cosine decay horizon (default: --steps)")
    run.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's weight decay, of the matrices only")
    run.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    run.add_argument(
        "--aux-loss-coef", type=float, help="load-balancing loss weight (default: the config's router_aux_loss_coef)"
    )
    run.add_argument("--z-loss-coef", type=float, default=0.0, help="router z-loss weight")
    run.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches drawn")
    mesh = parser.add_argument_group("devices")
    flags.add_device_arguments(mesh)
    mesh.add_argument(
        "--peak-tflops",
        type=float,
        help="per-device peak in TFLOP/s, the denominator of MFU (default: the bf16 matmul rate measured on an H100 "
        "or an H200; on other devices no MFU)",
    )
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
        help="per-device memory the plan must fit in, GB; the default is 90%% of an H200's 141 GB: for another GPU "
        "pass about 90%% of its memory",
    )
    args = parser.parse_args(argv)

    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.lr_decay_steps = args.lr_decay_steps or args.steps
    positive: tuple[str, ...]
    positive = ("steps", "batch", "seq", "eval_every", "eval_batches", "ckpt_every", "lr_decay_steps", "lr")
    positive += ("grad_clip", "corpus_bytes", "memory_budget_gb", "peak_tflops")
    non_negative = ("warmup", "weight_decay", "aux_loss_coef", "z_loss_coef", "seed")
    flags.check_arguments(parser, args, positive, non_negative)
    if args.data and not os.path.isfile(args.data):
        parser.error(f"--data: no such file: {args.data}")
    if args.resume and not args.ckpt_dir:
        parser.error("--resume needs --ckpt-dir")
    if args.resume and not os.path.isdir(args.ckpt_dir):  # checked here: opening the checkpoints would create it
        parser.error(f"--resume: --ckpt-dir {args.ckpt_dir} does not exist: pass the directory of the run to continue")
    return args


def choose_mesh(args, num_devices: int, num_experts: int) -> None:
    """Fills in --mesh-data / --mesh-expert and a per-device preset batch, and checks them against the devices,
    the experts and the batch."""
    if args.batch is None:
        args.batch = SEQUENCES_PER_DEVICE * num_devices
    flags.choose_mesh(args, num_devices, num_experts)
    if args.batch % num_devices:
        raise cli.UsageError(f"--batch {args.batch} must be divisible by the {num_devices} devices of the mesh")


def main(argv=None) -> None:
    args = parse_args(argv)
    jax = flags.start_jax(args)
    from moe_training import data, model_from_flags, pretrain

    config = flags.model_config(args.preset, args.layers)
    if args.seq > config.max_position_embeddings:
        raise cli.UsageError(
            f"--seq {args.seq} exceeds the model's max_position_embeddings {config.max_position_embeddings}: pass "
            f"--seq {config.max_position_embeddings} or less"
        )
    choose_mesh(args, jax.device_count(), config.num_experts)
    model_from_flags.check_platform(args)
    if args.aux_loss_coef is None:
        args.aux_loss_coef = config.router_aux_loss_coef
    if args.dry_run:
        pretrain.dry_run(args, config)
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
    summary = pretrain.train(args, config, train_tokens, eval_tokens)
    if summary:
        speed = summary["tokens_per_s"]
        print(
            f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} (mean of the last steps; eval "
            f"{summary['final_eval_loss']:.3f}); {f'{speed:,.0f}' if speed else 'n/a'} tokens/s; outputs in "
            f"{args.out_dir}"
        )


if __name__ == "__main__":
    cli.run(main)
