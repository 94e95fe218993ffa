"""GPU training record (issue 5, item 5): a Qwen3-30B-A3B-width model with 4 layers, bf16, on one GPU,
trained twice from the same seed on the same data, once with jax_megamoe's CUDA implementation and once with
a pure-JAX baseline: `--baseline ragged_dot` (sort + `jax.lax.ragged_dot`, the default) or
`--baseline reference` (the per-expert dense reference implementation, exact but E times the expert FLOPs).

    python -m benchmarks.train_record OUT_DIR [--steps 150 --batch 2 --seq 1024]

Runs examples/train_qwen3_moe.py once per implementation (a fresh process each, so peak memory is per run) and
writes OUT_DIR/{cuda,BASELINE}/ (metrics.jsonl, loss_curve.png, summary.json), OUT_DIR/loss_curves.png
(both runs) and OUT_DIR/summary.json (tokens/s, MFU, peak memory, losses, and how closely the runs
agree: the final losses, the means of `--window`-step windows of the training loss, and the eval losses on
the same held-out batches every `--eval-every` steps, each against 1%). Per-step training losses are
not compared: once bf16 rounding makes two runs' parameters differ, single batches' losses drift apart
by several percent while the curves stay together. A baseline that fails (ragged_dot ran out of memory on one
H200 even at 2048 tokens per step, benchmarks/README.md) is recorded as failed and the CUDA run is kept.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import ROOT
from jax_megamoe import cli, training

BASELINES = ("ragged_dot", "reference")


def run_implementation(implementation: str, args, out_dir: Path, device: str) -> dict:
    command = [
        sys.executable,
        str(ROOT / "examples" / "train_qwen3_moe.py"),
        "--preset",
        "qwen3-30b-a3b-4layer",
        "--implementation",
        implementation,
        "--dtype",
        "bfloat16",
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--seed",
        str(args.seed),
        "--eval-every",
        str(args.eval_every),
        "--eval-batches",
        str(args.eval_batches),
        "--attention-impl",
        args.attention_impl,
        "--mesh-data",
        "1",
        "--mesh-expert",
        "1",
        "--out-dir",
        str(out_dir),
        *args.extra,
    ]
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command, env=dict(os.environ, CUDA_VISIBLE_DEVICES=device))
    if result.returncode:  # e.g. the ragged_dot baseline running out of memory: a result, not a crash
        return {"failed": True, "returncode": result.returncode}
    return json.loads((out_dir / "summary.json").read_text())


def agreement(cuda: list[dict], baseline: list[dict], window: int) -> dict:
    """Relative gaps (cuda − baseline) / baseline of the eval losses at each common eval step, and of the
    training loss's means over consecutive `window`-step windows (complete windows both runs reached)."""

    def gaps(pairs):
        pairs = [(key, (a - b) / b) for key, a, b in pairs]
        return {"relative_gaps": pairs, "within_1pct": bool(pairs) and all(abs(g) <= 0.01 for _, g in pairs)}

    evals = [{r["step"]: r["eval_loss"] for r in run if "eval_loss" in r} for run in (cuda, baseline)]
    losses = [[r["loss"] for r in run if "loss" in r] for run in (cuda, baseline)]
    steps = min(map(len, losses)) // window * window
    mean = statistics.fmean
    return {
        "eval_loss": gaps(
            [(step, evals[0][step], evals[1][step]) for step in sorted(evals[0].keys() & evals[1].keys())]
        ),
        f"train_loss_{window}_step_means": gaps(
            [
                (
                    f"{start + 1}-{start + window}",
                    mean(losses[0][start : start + window]),
                    mean(losses[1][start : start + window]),
                )
                for start in range(0, steps, window)
            ]
        ),
    }


def main() -> None:
    parser = cli.Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="output folder")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=50, help="steps between eval losses of both runs")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per eval")
    parser.add_argument("--window", type=int, default=50, help="steps per training-loss window compared")
    parser.add_argument(
        "--device",
        default="0",
        help="GPU of both runs, one after the other; or two GPUs 'A,B': the CUDA run on A and the "
        "baseline on B at the same time (separate GPUs, so each run's speed is its own)",
    )
    parser.add_argument(
        "--attention-impl",
        choices=["cudnn", "xla"],
        default="cudnn",
        help="attention for both runs (the published end-to-end records used cuDNN)",
    )
    parser.add_argument(
        "--baseline",
        choices=BASELINES,
        default="ragged_dot",
        help="the pure-JAX run the CUDA implementation is compared with",
    )
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.extra = argv[split + 1 :]  # more train_qwen3_moe.py flags, after `--`
    if args.steps < 20:
        parser.error("--steps must be >= 20 (the final loss averages the last 10 steps)")

    implementations = ("cuda", args.baseline)
    devices = args.device.split(",")
    if len(devices) not in (1, 2):
        parser.error(f"--device takes one GPU or two ('A,B'), got {args.device!r}")
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(devices)) as pool:
        futures = {
            name: pool.submit(run_implementation, name, args, args.out_dir / name, devices[i % len(devices)])
            for i, name in enumerate(implementations)
        }
        summaries = {name: future.result() for name, future in futures.items()}
    done = [b for b in implementations if not summaries[b].get("failed")]
    record: dict = {"runs": summaries, "final_loss_mean_last_10_steps": {b: summaries[b]["final_loss"] for b in done}}
    curves = {b: training.read_metrics(str(args.out_dir / b / "metrics.jsonl")) for b in done}
    if len(done) == len(implementations):
        finals = record["final_loss_mean_last_10_steps"]
        gap = abs(finals["cuda"] - finals[args.baseline]) / finals[args.baseline]
        record.update(
            final_loss_relative_gap=gap,
            within_1pct=gap <= 0.01,
            speedup_tokens_per_s=(summaries["cuda"]["tokens_per_s"] / summaries[args.baseline]["tokens_per_s"]),
            agreement=agreement(curves["cuda"], curves[args.baseline], args.window),
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "summary.json").write_text(json.dumps(record, indent=2))
    training.plot_loss_curves(curves, str(args.out_dir / "loss_curves.png"))

    print("| implementation | tokens/s | MFU | step ms | peak GiB | final loss |")
    print("|---|---|---|---|---|---|")
    for name, s in summaries.items():
        if s.get("failed"):
            print(f"| {name} | failed (exit code {s['returncode']}) | | | | |")
            continue
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] else "-"
        peak = f"{s['peak_memory_bytes'] / 2**30:.1f}" if s["peak_memory_bytes"] else "-"
        print(
            f"| {name} | {s['tokens_per_s']:,.0f} | {mfu} | {1e3 * s['median_step_time_s']:.1f} | {peak} "
            f"| {s['final_loss']:.4f} |"
        )
    if "final_loss_relative_gap" in record:
        print(
            f"final-loss gap {100 * record['final_loss_relative_gap']:.2f}% (within 1%: {record['within_1pct']}); "
            f"speedup {record['speedup_tokens_per_s']:.2f}x"
        )
        for kind, gaps in record["agreement"].items():
            print(
                f"{kind}: "
                + ", ".join(f"{step}: {100 * g:+.2f}%" for step, g in gaps["relative_gaps"])
                + f" (all within 1%: {gaps['within_1pct']})"
            )
    print(f"outputs in {args.out_dir}")
    if summaries["cuda"].get("failed"):
        raise cli.RunError(f"the CUDA run failed (exit code {summaries['cuda']['returncode']}); its output is above")


if __name__ == "__main__":
    cli.run(main)
