"""Where the sampler's and the trainer's log-probs part: `generate`'s log-probs of the tokens it sampled against the
training forward's on the same rows (`rl.sequence_logprobs`, as the RL job computes them), without and with the
sampler's routing record replayed, for each MoE implementation and attention implementation asked for.

Every configuration runs the same weights (random, `--seed`, or a trained model's: `--checkpoint`, a Hugging Face
checkpoint directory such as the `model/` the training and RL jobs save), prompts and sampling keys: `--prompts`
prompts of random lengths up to `--prompt` tokens, `--new` new tokens each at temperature 1. Per configuration, over the
sampled tokens: the largest, mean and 99th-percentile |log ratio| (trainer minus sampler), the k3 estimate of
KL(sampler || trainer) (the mean of `r - 1 - log r`), the share of routing choices the trainer's router makes
differently from the sampler's record, and the same log-ratio figures and KL with the record replayed
(`jax_megamoe.rl.mismatch_stats`, as the RL job logs them). Replay takes routing flips out, so what remains with it
is the rest of the numerics: attention over the cache against attention over the whole sequence, a decode row's
GEMM shapes against a sequence's, the LM head.

Usage: python -m benchmarks.logprob_mismatch [--model tiny|q30-4layer | --checkpoint DIR]
                                             [--implementations auto,reference]
                                             [--attention xla,cudnn] [--dtype bfloat16] [--param-dtype float32]
                                             [--recipe fp8_blockwise]
                                             [--prompts 16] [--prompt 64] [--new 64] [--seed 0] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import comma_list
from jax_megamoe import cli  # the command-line jobs' exit-code rule

ATTENTION = {"xla": None, "cudnn": "cudnn"}


def measure(model, prompts, args) -> dict:
    """One configuration's figures (`model` built with its implementation and attention)."""
    import jax
    from flax import nnx

    from jax_megamoe import rl
    from jax_megamoe.models import qwen3_moe

    out = qwen3_moe.generate(
        model, prompts, max_new_tokens=args.new, temperature=1.0, key=jax.random.key(args.seed), return_routing=True
    )
    prompt_ids, prompt_lengths = rl.pad_prompts(prompts, args.prompt)
    tokens, lengths, logprobs, routing = jax.device_get((out.tokens, out.lengths, out.logprobs, out.routing))
    rows = rl.pack(prompt_ids, prompt_lengths, tokens, lengths, logprobs, routing=routing)

    @nnx.jit
    def trainer(model, rows):
        own, aux = rl.sequence_logprobs(model, rows.tokens, return_routing=True)
        assert aux.routing is not None  # asked for
        replayed, _ = rl.sequence_logprobs(model, rows.tokens, routing=rows.routing)
        figures = rl.mismatch_stats(own, rows.sampler_logprobs, rows.mask)
        figures["routing_mismatch"] = rl.routing_mismatch(rows.routing[:, :-1], aux.routing)
        replay = rl.mismatch_stats(replayed, rows.sampler_logprobs, rows.mask)
        return figures | {f"replay_{name}": value for name, value in replay.items()}

    figures = {name: float(value) for name, value in trainer(model, rows).items()}
    return figures | {"tokens": int(rows.mask.sum())}


def table(rows) -> str:
    lines = [
        "| MoE | attention | max | mean | p99 | KL | routing differs | replayed: max | mean | p99 | KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        plain = [f"{row[k]:.3g}" for k in ("log_ratio_max", "log_ratio_mean", "log_ratio_p99", "sampler_kl")]
        replay = [
            f"{row['replay_' + k]:.3g}" for k in ("log_ratio_max", "log_ratio_mean", "log_ratio_p99", "sampler_kl")
        ]
        flips = f"{100 * row['routing_mismatch']:.2f}%"
        lines.append(f"| {row['implementation']} | {row['attention']} | " + " | ".join([*plain, flips, *replay]) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    weights_from = parser.add_mutually_exclusive_group()
    weights_from.add_argument("--model", default="tiny", choices=("tiny", "q30-4layer"), help="random weights")
    weights_from.add_argument("--checkpoint", help="a Hugging Face checkpoint directory's weights instead")
    parser.add_argument("--implementations", type=comma_list(("auto", "cuda", "cpu", "reference")), default=["auto"])
    parser.add_argument("--attention", type=comma_list(tuple(ATTENTION)), default=["xla"])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="compute dtype")
    parser.add_argument(
        "--param-dtype",
        default="float32",
        choices=("bfloat16", "float32"),
        help="parameter dtype (the RL job's: float32)",
    )
    parser.add_argument("--recipe", choices=("fp8_blockwise",), help="the MoE layers' FP8 recipe (default: none)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts, one sample each")
    parser.add_argument("--prompt", type=int, default=64, help="the longest prompt's tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling keys")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    for flag in ("prompts", "prompt", "new"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.bench_generate import model_config
    from jax_megamoe.models import qwen3_moe
    from jax_megamoe.ops.moe import resolve_implementation

    # What this machine cannot run is a usage error before any model is built.
    for implementation in args.implementations:
        try:
            resolve_implementation(implementation)
        except ValueError as error:
            raise cli.UsageError(f"--implementations {implementation}: {error}") from None
    if "cudnn" in args.attention and jax.default_backend() != "gpu":
        raise cli.UsageError(f"--attention cudnn needs a GPU; JAX's backend is {jax.default_backend()!r}")
    if args.checkpoint is not None:
        try:
            config = qwen3_moe.Qwen3MoeConfig.from_json(args.checkpoint)
        except (OSError, ValueError) as error:
            raise cli.UsageError(f"--checkpoint {args.checkpoint}: {error}") from None
    else:
        config = model_config(args.model)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(1, args.prompt + 1, args.prompts)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    dtype, param_dtype = jnp.dtype(args.dtype), jnp.dtype(args.param_dtype)
    weights = None
    rows = []
    for implementation in args.implementations:
        for attention in args.attention:
            options = dict(dtype=dtype, param_dtype=param_dtype, implementation=implementation, recipe=args.recipe,
                           attention_impl=ATTENTION[attention])  # fmt: skip
            if weights is None and args.checkpoint is not None:
                model = qwen3_moe.from_pretrained(args.checkpoint, **options)
            else:
                model = qwen3_moe.Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(args.seed), **options)
            if weights is None:
                weights = nnx.state(model, nnx.Param)
            else:  # every configuration the same weights
                nnx.update(model, weights)
            row = dict(implementation=implementation, attention=attention, **measure(model, prompts, args))
            rows.append(row)
            print(json.dumps(row), flush=True)
    weights_of = args.checkpoint or args.model
    recipe = f", {args.recipe}" if args.recipe else ""
    print(f"{weights_of}, {args.dtype}{recipe}, {jax.devices()[0].device_kind}: {args.prompts} prompts of up to "
          f"{args.prompt} tokens, {args.new} new tokens at temperature 1")  # fmt: skip
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, device=jax.devices()[0].device_kind, argv=sys.argv), f, indent=1)
    return rows


if __name__ == "__main__":
    cli.run(main)
