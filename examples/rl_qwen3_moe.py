"""RL post-training of a Qwen3-MoE model with GRPO, sampling and training on jax_megamoe's MoE kernels.

With no arguments it teaches the tiny byte-level model to reverse digit strings on 8 host CPU devices (or the
GPU): a short supervised warm-up on the task's answers, then GRPO steps (a group of samples per prompt, rewards
normalised within the group as advantages, the clipped ratio against the sampler's log-probs, an optional KL term
to the starting policy, no value model) until its held-out accuracy is high:

    python examples/rl_qwen3_moe.py
    python examples/rl_qwen3_moe.py --init runs/train_qwen3_moe/model --task add      # a saved model
    python examples/rl_qwen3_moe.py --preset qwen3-30b-a3b-4layer                     # one GPU: 30B width, timing

Writes metrics.jsonl, rl_curve.png, mismatch_curve.png, summary.json and the final model (model/, Hugging Face
layout) to --out-dir; --ckpt-dir/--resume checkpoint with orbax (the policy, its optimizer state, the KL reference
and the sampler's key). A command line that cannot run exits with status 2, a run that fails with 1
(jax_megamoe/cli.py). `--help` lists every flag. Docs: docs/models.md.
"""

from __future__ import annotations

import os

from jax_megamoe import cli
from moe_training import flags  # the recipes beside this script (JAX is imported later)

PRESETS = {  # name -> defaults of the flags below; the model configs are built after JAX starts
    "tiny": dict(
        task="reverse",
        prompts=32,
        group=16,
        steps=200,
        lr=5e-4,
        warmup=5,
        sft_steps=30,
        sft_lr=3e-3,
        kl_coef=0.01,
        minibatches=4,
        eval_every=10,
        eval_problems=128,
        prompt_len=8,
    ),
    # Random weights at Qwen3-30B-A3B's widths, 4 layers, on the synthetic task: the loop's timing on one GPU.
    "qwen3-30b-a3b-4layer": dict(
        task="synthetic",
        prompts=16,
        group=8,
        steps=10,
        lr=1e-6,
        warmup=0,
        sft_steps=0,
        sft_lr=1e-5,
        kl_coef=0.01,
        minibatches=4,
        eval_every=10,
        eval_problems=64,
        prompt_len=256,
        max_new_tokens=256,
    ),
}


def _preset_default(key: str) -> str:
    return "default from --preset: " + ", ".join(f"{name} {preset.get(key)}" for name, preset in PRESETS.items())


def parse_args(argv=None):
    parser, model = flags.job_parser(
        __doc__.split("\n\n")[0],
        PRESETS,
        "tiny: byte-level 2-layer model; qwen3-30b-a3b-4layer: Qwen3-30B-A3B widths, 4 layers, random weights",
    )
    model.add_argument(
        "--init",
        help="start from this Hugging Face Qwen3-MoE checkpoint directory (config.json + safetensors, e.g. the "
        "model/ the training job saves) instead of the preset's random weights; text through its tokenizer.json, "
        "else as bytes",
    )
    flags.add_model_arguments(model)
    task = parser.add_argument_group("task and sampling")
    task.add_argument(
        "--task",
        choices=["reverse", "add", "synthetic"],
        help="reverse: a digit string reversed; add: the sum of two numbers (both rewarded with the share of the "
        "answer's characters in place, over the longer of answer and completion, 0 without the end token); "
        "synthetic: rewarded with the share of digits in the completion (any model, no warm-up); "
        + _preset_default("task"),
    )
    task.add_argument("--max-digits", type=int, default=3, help="reverse, add: longest number in digits")
    task.add_argument(
        "--prompt-len", type=int, help="synthetic: prompt length in letters; " + _preset_default("prompt_len")
    )
    task.add_argument(
        "--prompt-width", type=int, help="prompt slots in tokens (default: the task's longest prompt in characters)"
    )
    task.add_argument(
        "--max-new-tokens", type=int, help="tokens sampled per completion (default: the task's longest answer + 1)"
    )
    task.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    task.add_argument("--top-k", type=int, help="sample among the k likeliest tokens only")
    task.add_argument("--top-p", type=float, help="sample from the smallest set of tokens of probability >= p")
    grpo = parser.add_argument_group("GRPO")
    grpo.add_argument("--steps", type=int, help="GRPO steps; " + _preset_default("steps"))
    grpo.add_argument("--prompts", type=int, help="prompts per step; " + _preset_default("prompts"))
    grpo.add_argument("--group", type=int, help="samples per prompt; " + _preset_default("group"))
    grpo.add_argument(
        "--minibatches",
        type=int,
        help="optimizer steps per pass over a step's samples; " + _preset_default("minibatches"),
    )
    grpo.add_argument("--epochs", type=int, default=1, help="passes over each step's samples")
    grpo.add_argument("--lr", type=float, help="peak learning rate; " + _preset_default("lr"))
    grpo.add_argument(
        "--warmup", type=int, help="linear learning-rate warm-up (optimizer steps); " + _preset_default("warmup")
    )
    grpo.add_argument(
        "--lr-decay-steps", type=int, help="cosine decay horizon in optimizer steps (default: all of them)"
    )
    grpo.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW's weight decay, of the matrices only, in the warm-up too"
    )
    grpo.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    grpo.add_argument("--clip-epsilon", type=float, default=0.2, help="the ratio's clip range, 1 +- epsilon")
    grpo.add_argument(
        "--routing-replay",
        action="store_true",
        help="the training forward's sparse layers use the experts the sampler chose for each token (weighted by "
        "the trainer's router), so sampler and trainer cannot route apart",
    )
    grpo.add_argument(
        "--behaviour",
        choices=["sampler", "trainer"],
        default="sampler",
        help="the policy the ratio divides by: the sampler's log-probs, or the trainer's own recomputed before the "
        "first update, each token weighted by min(pi_trainer / pi_sampler, --tis-cap) (truncated importance "
        "sampling; one more forward per minibatch; needs --temperature 1 without --top-k/--top-p, whose "
        "distribution the sampler's log-probs are)",
    )
    grpo.add_argument(
        "--tis-cap", type=float, default=2.0, help="--behaviour trainer: the importance weight's truncation"
    )
    grpo.add_argument(
        "--mask-band",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="--behaviour trainer: mask out the tokens whose pi_trainer / pi_sampler lies outside [LOW, HIGH]",
    )
    grpo.add_argument(
        "--kl-coef",
        type=float,
        help="weight of the KL term to the starting policy (0: no reference held); " + _preset_default("kl_coef"),
    )
    grpo.add_argument(
        "--aux-loss-coef", type=float, help="load-balancing loss weight (default: the config's router_aux_loss_coef)"
    )
    grpo.add_argument("--z-loss-coef", type=float, default=0.0, help="router z-loss weight")
    grpo.add_argument(
        "--sft-steps",
        type=int,
        help="supervised warm-up steps on the task's answers first; " + _preset_default("sft_steps"),
    )
    grpo.add_argument("--sft-lr", type=float, help="the warm-up's learning rate; " + _preset_default("sft_lr"))
    grpo.add_argument(
        "--seed", type=int, default=0, help="seed of the preset's initial weights, the problems drawn and the sampling"
    )
    flags.add_device_arguments(parser.add_argument_group("devices"))
    io = parser.add_argument_group("evaluation and outputs")
    io.add_argument(
        "--eval-every", type=int, help="steps between held-out evaluations; " + _preset_default("eval_every")
    )
    io.add_argument(
        "--eval-problems", type=int, help="held-out problems, answered greedily; " + _preset_default("eval_problems")
    )
    io.add_argument(
        "--out-dir",
        default="runs/rl_qwen3_moe",
        help="metrics.jsonl, rl_curve.png, mismatch_curve.png, summary.json, model/",
    )
    io.add_argument("--ckpt-dir", help="orbax checkpoint directory (no checkpoints without it)")
    io.add_argument("--ckpt-every", type=int, default=20, help="steps between checkpoints (the last always)")
    io.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    args = parser.parse_args(argv)

    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    positive: tuple[str, ...]
    positive = ("steps", "prompts", "minibatches", "epochs", "eval_every", "eval_problems", "ckpt_every", "max_digits")
    positive += ("prompt_len", "prompt_width", "max_new_tokens", "lr_decay_steps", "top_k")
    positive += ("lr", "sft_lr", "grad_clip", "clip_epsilon")
    non_negative = ("warmup", "sft_steps", "weight_decay", "kl_coef", "aux_loss_coef", "z_loss_coef", "seed")
    flags.check_arguments(parser, args, positive, non_negative)
    if args.group < 2:
        parser.error(f"--group must be >= 2 (GRPO compares the samples of a prompt), got {args.group}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0 (the group's samples must differ), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.behaviour == "trainer" and (args.temperature != 1 or args.top_k is not None or args.top_p is not None):
        parser.error(
            "--behaviour trainer weighs by pi_trainer / pi_sampler, and the sampler's log-probs are of the "
            "temperature-1 distribution without filters: use --temperature 1 and no --top-k/--top-p"
        )
    if args.behaviour != "trainer" and args.mask_band:
        parser.error("--mask-band masks by pi_trainer / pi_sampler: it needs --behaviour trainer")
    if args.mask_band and not 0 <= args.mask_band[0] < 1 < args.mask_band[1]:
        parser.error(f"--mask-band must be LOW HIGH with 0 <= LOW < 1 < HIGH, got {args.mask_band}")
    if not args.tis_cap >= 1:
        parser.error(f"--tis-cap must be >= 1, got {args.tis_cap}")
    if args.prompts * args.group % args.minibatches:
        parser.error(f"--minibatches {args.minibatches} must divide the {args.prompts * args.group} samples of a step")
    problem = flags.model_dir_problem(args.init) if args.init else None
    if problem:
        parser.error(f"--init: {problem}")
    if args.init and args.layers:
        parser.error("--layers changes the preset's model; --init's model has its own depth")
    if args.resume and not args.ckpt_dir:
        parser.error("--resume needs --ckpt-dir")
    if args.resume and not os.path.isdir(args.ckpt_dir):  # checked here: opening the checkpoints would create it
        parser.error(f"--resume: --ckpt-dir {args.ckpt_dir} does not exist: pass the directory of the run to continue")
    args.lr_decay_steps = args.lr_decay_steps or args.steps * args.minibatches * args.epochs
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    jax = flags.start_jax(args)
    from jax_megamoe.models import qwen3_moe
    from moe_training import model_from_flags, rl, rollouts
    from moe_training.tokenizer import Tokenizer

    config = (
        qwen3_moe.Qwen3MoeConfig.from_json(args.init) if args.init else flags.model_config(args.preset, args.layers)
    )
    task = rollouts.make_task(args)
    tokenizer = Tokenizer(args.init, config.vocab_size)
    if args.prompt_width + args.max_new_tokens > config.max_position_embeddings:
        raise cli.UsageError(
            f"--prompt-width {args.prompt_width} + --max-new-tokens {args.max_new_tokens} exceed the model's "
            f"max_position_embeddings {config.max_position_embeddings}"
        )
    flags.choose_mesh(args, jax.device_count(), config.num_experts)
    model_from_flags.check_platform(args)
    devices = jax.device_count()
    for flag, rows in (
        ("--prompts x --group / --minibatches", args.prompts * args.group // args.minibatches),
        ("--eval-problems", args.eval_problems),
    ):
        if rows % devices:
            raise cli.UsageError(f"{flag} = {rows} rows must be divisible by the {devices} devices of the mesh")
    if args.aux_loss_coef is None:
        args.aux_loss_coef = config.router_aux_loss_coef
    summary = rl.train(args, config, task, tokenizer)
    if summary:
        print(rl.format_summary(summary) + f"; outputs in {args.out_dir}")


if __name__ == "__main__":
    cli.run(main)
