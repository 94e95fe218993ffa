"""End-to-end training-step benchmark: our Qwen3-MoE training step against the peers, in one run.

Every stack trains the same config on the same tokens (random ids from one seed, `--batch` x `--seq` inputs
and their next-token labels), one subprocess each, so each one's peak memory is its own:

  ours             jax_megamoe's `Qwen3MoeForCausalLM` (bf16 compute, `--param-dtype` parameters, default
                   float32; implementation="auto"; cuDNN attention on GPUs), optax AdamW in one jitted step;
                   loss = LM cross-entropy by optax on the full float32 logits + the router's aux loss.
  ours_lce         the same with the LM head and its cross-entropy as `jax_megamoe.losses.linear_cross_entropy`
                   on `model.hidden_states` and `model.lm_head_kernel()` (no [N, V] logits).
  ours_lce_remat   ours_lce with `remat=True` and a policy saving moe_ffn's named residuals ("moe_layout",
                   "moe_gate_up"): the training example's `--remat --remat-save-moe`.
  ours_remat       the same with the optax head.
  ours_unrolled    ours with the decoder layers as a Python loop (`scan_layers=False`) instead of one
                   scan over stacked layers (`jax_megamoe.models.layer_scan`): what scanning costs or saves at
                   this depth.
  ours_fp8         ours with the experts' GEMMs in FP8 (`recipe="fp8_blockwise"`, docs/fp8.md): the training
                   job's `--recipe fp8_blockwise`.
  tokamax          the same JAX model and step (optax head, bf16 parameters) with the experts as a pure-JAX
                   sort + `tokamax.ragged_dot` (its Mosaic GPU kernel, pinned so that no silent fallback to XLA
                   is timed) passed as `implementation=`. GPU only. Its packages may sit in `--peer-site`
                   (a site directory after the environment's own, in that child only).
  ragged_dot       the same with `jax.lax.ragged_dot` instead (not run by default: XLA's lowering expands the
                   groups densely on GPUs; on a CPU it checks the peer's code path).
  torch            Hugging Face transformers' `Qwen3MoeForCausalLM` (bf16 parameters, sdpa attention, its
                   grouped_mm experts where the installed transformers offers them), torch.optim.AdamW
                   (fused), eager; loss = cross-entropy of the float32 logits + router_aux_loss_coef * aux loss.

Reported per stack: the median step time over `--steps` steps after `--warmup` steps (each step synchronised
with the device), tokens/s, MFU (model FLOPs: 6 per active matmul parameter per token plus causal attention,
over a bf16 matmul rate measured in the same run: 8192^3, median of several, torch on GPUs, JAX elsewhere),
peak device memory (None where the platform keeps no statistics, e.g. CPUs), the first step's LM loss
(near ln(vocab) at initialisation). For `--breakdown` stacks (ours, ours_lce by default) in the same process:
experts = step - the same step with the experts replaced by a zero function (moe_ffn and its weight casts;
the router stays); optimizer = step - the step without the optimizer update (loss and gradients only);
LM head + loss = forward+backward of the head and its cross-entropy alone, on [N, H] bf16 hidden states
(random: the time does not depend on their values) and the head's parameter; rest = what remains
(attention, norms, router, embedding). Beside them, `moe_ffn_alone_ms`: one moe_ffn per sparse layer at the
step's size, forward+backward with the weight casts, in one jitted call, and `experts_over_alone`, the experts
term over it (what the MoE layers cost inside the step against alone).
With `--profile DIR`, each JAX stack then runs `PROFILE_STEPS` more steps under the JAX profiler (the trace in
DIR/<stack>/, for Perfetto) and its row gets `profile`: the device's events per step by time (the top
`PROFILE_TOP`), and the last step's streams: each stream's busy time and the busiest one's idle gaps (where the
step waits, and for what).

Usage: python -m benchmarks.bench_train [--preset qwen3-30b-a3b-4layer|tiny] [--layers L] [--batch B]
           [--seq S] [--steps N] [--warmup W] [--param-dtype float32|bfloat16] [--stacks ours,ours_lce,...]
           [--breakdown ours,ours_lce] [--profile DIR] [--peer-site DIR] [--json F] [--png F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from benchmarks.train_bench.children import child, run_child
from benchmarks.train_bench.common import BETAS, LEARNING_RATE, WEIGHT_DECAY, model_config
from benchmarks.train_bench.plot import plot
from benchmarks.train_bench.rates import train_flops_per_step, with_rates
from benchmarks.train_bench.report import table
from benchmarks.train_bench.stacks import DEFAULT_BREAKDOWN, DEFAULT_STACKS, STACKS, stack_label
from jax_megamoe import cli  # the command-line jobs' exit-code rule

# Per preset: (layers, batch, seq, steps, warmup); the flags override each.
PRESETS = {"qwen3-30b-a3b-4layer": (4, 4, 4096, 10, 3), "tiny": (2, 2, 32, 3, 1)}
PARAM_DTYPES = ("float32", "bfloat16")


def parse_list(text: str, known, flag: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip() and s.strip() != "none"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise cli.UsageError(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    return list(dict.fromkeys(names))


def main(argv=None) -> dict | None:
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b-4layer")
    parser.add_argument("--layers", type=int, help="decoder layers (preset default: 4, tiny: 2)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, help="timed steps after the warm-up (median over them)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="float32",
        help="our stacks' parameter dtype (the peers keep bf16)",
    )
    parser.add_argument("--stacks", default=",".join(DEFAULT_STACKS), help=f"comma list of {', '.join(STACKS)}")
    parser.add_argument(
        "--breakdown",
        default=",".join(DEFAULT_BREAKDOWN),
        help="our stacks that also time the breakdown's variants ('none': no breakdown)",
    )
    parser.add_argument(
        "--profile", help="folder for a JAX profiler trace of each JAX stack's steps, summarised in its row"
    )
    parser.add_argument(
        "--peer-site",
        default=os.environ.get("JMM_PEER_SITE"),
        help="folder of tokamax's packages, a site directory after the environment's own in the tokamax child only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matmul-size", type=int, help="the matmul rate's size (8192 on GPUs, 512 on CPUs)")
    parser.add_argument("--child-timeout", type=float, default=1500, help="seconds per stack's subprocess")
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the whole run: a stack is stopped when it is spent, and the stacks not "
        "started yet are recorded as not run (the JSON, chart and table are still written)",
    )
    parser.add_argument("--json", default="bench_train.json")
    parser.add_argument("--png", default="bench_train.png", help="bar chart ('' for none)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, default in zip(("layers", "batch", "seq", "steps", "warmup"), PRESETS[args.preset], strict=True):
        if getattr(args, key) is None:
            setattr(args, key, default)
    if min(args.layers, args.batch, args.seq, args.steps) < 1 or args.warmup < 0:
        parser.error("--layers, --batch, --seq and --steps must be positive, --warmup non-negative")
    stacks = parse_list(args.stacks, STACKS, "--stacks")
    args.breakdown = parse_list(args.breakdown, [s for s in STACKS if s.startswith("ours")], "--breakdown")
    if args.child:
        child(args)
        return None

    config = model_config(args.preset, args.layers)
    tokens_per_step = args.batch * args.seq
    flops = train_flops_per_step(config, args.batch, args.seq)
    result = dict(
        preset=args.preset,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        warmup=args.warmup,
        param_dtype=args.param_dtype,
        seed=args.seed,
        tokens_per_step=tokens_per_step,
        flops_per_step=flops,
        config=config.to_dict(),
        optimizer=dict(name="AdamW", lr=LEARNING_RATE, betas=BETAS, weight_decay=WEIGHT_DECAY),
        aux_loss_coef=config.router_aux_loss_coef,
        argv=sys.argv,
        stacks=[],
    )
    start = time.perf_counter()

    def time_left() -> float:
        spent = time.perf_counter() - start
        return min(args.child_timeout, args.time_budget - spent if args.time_budget else math.inf)

    result["matmul"] = run_child(args, "matmul", time_left())
    matmul_tflops = result["matmul"].get("tflops") if result["matmul"].get("status") == "ok" else None
    print(f"[matmul: {result['matmul'].get('status')}, {time.perf_counter() - start:.0f} s]", flush=True)

    def save():  # after every stack, so a run cut short keeps its rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    for name in stacks:
        began = time.perf_counter()
        left = time_left()
        outcome = (
            run_child(args, name, left)
            if left > 0
            else dict(status=f"not run: the time budget of {args.time_budget:g} s was spent")
        )
        row = dict(stack=name, label=stack_label(name, args.param_dtype), **outcome)
        row["wall_s"] = time.perf_counter() - began
        result["stacks"].append(with_rates(row, tokens_per_step, flops, matmul_tflops))
        print(f"[{name}: {row['status']}, {row['wall_s']:.0f} s]", flush=True)
        save()
    save()
    if args.png:
        plot(result, args.png)
    print(table(result))
    return result


if __name__ == "__main__":
    cli.run(main)
