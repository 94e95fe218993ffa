"""Sampling benchmark: `jax_megamoe.models.qwen3_moe.generate` against transformers' `generate`, in one run.

Each row is one framework, model and batch, in a subprocess of its own (its peak memory is its own): prompts of
`--prompt` random tokens, `--new` greedy tokens after each (no end-of-sequence token, so every row decodes them
all), bf16 weights initialised at random by each framework. Reported per row:
- `tokens/s`: generated tokens (batch x new) over the time of the whole `generate` call, prefill included;
- `step ms`: one decode step, `(t(new) - t(1)) / (new - 1)` from two timed calls (t(1) is prefill and the first
  token), so the prefill cancels out;
- the step's floor: the bytes one decode step must read at the mean cache length (every non-expert weight, the
  weights of the experts a batch of this size touches in expectation under uniform routing,
  `E * (1 - (1 - K/E)^batch)` per layer, the LM head, and the KV cache's valid entries) over the GPU's read
  bandwidth measured in the same run (`bench_moe.py`'s read-bandwidth row), and `x floor`, the step's multiple of it.
Frameworks: `ours` (jax_megamoe, bf16, the default implementation: the CUDA kernels on a GPU), `transformers`
(Hugging Face `Qwen3MoeForCausalLM` in torch, bf16, its grouped_mm experts where the version has them, a static
cache with `torch.compile` of the forward where that works, else its default cache in eager mode: the row's
`mode` says which). Models: `q30-4layer` (Qwen3-30B-A3B widths, 4 layers), `q30` (the full-depth Qwen3-30B-A3B:
61 GB of bf16 weights), `tiny` (the CPU smoke size). Times are medians over `--samples` calls after warm-up.

`--workload long-tail` measures continuous batching instead: `--prompts` prompts with long-tailed budgets
(`long_tail_budgets`: exponential with mean `--new` / 4, at most `--new`, seed 0; random weights rarely emit an
eos token, so the budgets make the tail) through R rows for each `--batches` value R: static batches of R prompts one
after another, each running until its longest budget, against one `generate(..., rows=R)` call; tokens/s of each.

Usage: python -m benchmarks.bench_generate [--models q30-4layer,q30] [--batches 1,16,64,256]
                                          [--frameworks ours,transformers] [--prompt 512] [--new 256] [--json F]
                                          [--workload batch|long-tail] [--prompts 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import benchmarks
from benchmarks.moe_bench.device_rates import BANDWIDTH_ROW, run_read_bandwidth
from jax_megamoe import cli  # the command-line jobs' exit-code rule

MODELS = ("tiny", "q30-4layer", "q30")
FRAMEWORKS = ("ours", "transformers")
BATCHES = (1, 16, 64, 256)


def model_config(name):
    from jax_megamoe.models import qwen3_moe

    if name == "tiny":
        return qwen3_moe.tiny()
    config = qwen3_moe.qwen3_30b_a3b()
    return dataclasses.replace(config, num_hidden_layers=4) if name == "q30-4layer" else config


def step_floor_bytes(config, batch: int, cache_len: float, weight_bytes: int = 2) -> float:
    """The bytes one decode step of `batch` rows must read, `cache_len` tokens already cached per row."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q and o, k and v
    total = 0.0
    for layer in range(layers):
        total += attention
        if config.is_moe_layer(layer):
            e, k = config.num_experts, config.num_experts_per_tok
            touched = e * (1 - (1 - k / e) ** batch)
            total += h * e + touched * 3 * h * config.moe_intermediate_size  # router, experts
        else:
            total += 3 * h * config.intermediate_size
    total += config.vocab_size * h  # LM head (tied or not, the table is read once)
    kv_cache = batch * cache_len * layers * 2 * kv_heads * head_dim
    return (total + kv_cache) * weight_bytes


_CHILD_START = time.perf_counter()


def progress(what: str) -> None:
    """One line on stderr: how far this child got, and when (a run stopped from outside still shows it)."""
    print(f"  [{time.perf_counter() - _CHILD_START:6.1f} s] {what}", file=sys.stderr, flush=True)


def timed(fn, sync, samples, what: str):
    """Median seconds of `fn()` over `samples` synchronised calls, after two warm-up calls."""
    for _ in range(2):
        sync(fn())
    progress(f"{what}: warmed up")
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - start)
    progress(f"{what}: {samples} timed, median {statistics.median(times):.3f} s")
    return statistics.median(times)


def prompt_tokens(vocab: int, batch: int, length: int, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int32)


def run_ours(model_name, batch, args):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_megamoe.models import qwen3_moe

    device = jax.devices()[0]
    row = dict(framework="ours", model=model_name, batch=batch, device=device.device_kind, mode="jit")
    config = model_config(model_name)
    model = nnx.jit(
        lambda: qwen3_moe.Qwen3MoeForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )()
    progress(f"{model_name}: model built")
    prompts = jnp.asarray(prompt_tokens(config.vocab_size, batch, args.prompt))
    lengths = jnp.full((batch,), args.prompt, jnp.int32)

    def call(new):
        return lambda: (
            qwen3_moe.generate(model, prompts, prompt_lengths=lengths, max_new_tokens=new, temperature=0.0).tokens
        )

    row["generate_s"] = timed(call(args.new), jax.block_until_ready, args.samples, f"generate {args.new} tokens")
    row["prefill_s"] = timed(call(1), jax.block_until_ready, args.samples, "generate 1 token")
    stats = device.memory_stats() or {}
    row["peak_gib"] = stats.get("peak_bytes_in_use", float("nan")) / 2**30
    return row


def long_tail_budgets(count: int, new: int, seed: int = 0):
    """Per-prompt token budgets with a long tail, as RL completions have: exponential with mean new / 4, rounded up
    and clipped to [1, new]."""
    import numpy as np

    draws = np.random.default_rng(seed).exponential(new / 4, count)
    return np.clip(np.ceil(draws), 1, new).astype(int).tolist()


def run_long_tail(model_name, rows, args):
    """`--prompts` prompts of long-tailed budgets through `rows` rows: static batches of `rows` prompts one after
    another (each until its longest budget), against one continuous-batching call (`generate(rows=...)`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_megamoe.models import qwen3_moe

    device = jax.devices()[0]
    config = model_config(model_name)
    model = nnx.jit(
        lambda: qwen3_moe.Qwen3MoeForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )()
    progress(f"{model_name}: model built")
    prompts = jnp.asarray(prompt_tokens(config.vocab_size, args.prompts, args.prompt))
    budgets = long_tail_budgets(args.prompts, args.new)
    chunks = [(prompts[i : i + rows], budgets[i : i + rows]) for i in range(0, args.prompts, rows)]

    def static():
        return [qwen3_moe.generate(model, p, max_new_tokens=b, temperature=0.0).tokens for p, b in chunks]

    def continuous():
        return qwen3_moe.generate(model, prompts, max_new_tokens=budgets, temperature=0.0, rows=rows).tokens

    row = dict(framework="ours", model=model_name, batch=rows, device=device.device_kind, workload="long-tail")
    row["tokens"] = sum(budgets)
    row["static_s"] = timed(static, jax.block_until_ready, args.samples, "static batches")
    row["continuous_s"] = timed(continuous, jax.block_until_ready, args.samples, "continuous batching")
    return row


def run_transformers(model_name, batch, args):
    import torch
    import transformers

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    row = dict(framework="transformers", model=model_name, batch=batch, device=str(dev))
    row["version"] = transformers.__version__
    config = model_config(model_name)
    values = {k: v for k, v in config.to_dict().items() if k not in ("architectures", "model_type")}
    hf_config = transformers.Qwen3MoeConfig(**values)
    torch.manual_seed(0)
    kwargs = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    hf_model = transformers.Qwen3MoeForCausalLM
    with torch.device(dev):
        try:  # transformers' own grouped_mm experts where this version offers them
            model = hf_model._from_config(hf_config, experts_implementation="grouped_mm", **kwargs)
        except (TypeError, ValueError, ImportError):
            model = hf_model._from_config(hf_config, **kwargs)
    model.eval()
    progress(f"{model_name}: transformers model built")
    row["experts_implementation"] = getattr(model.config, "_experts_implementation", None) or "eager"
    prompts = torch.from_numpy(prompt_tokens(config.vocab_size, batch, args.prompt)).long().to(dev)
    mask = torch.ones_like(prompts)

    def sync(_):
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def call(new, **options):
        def generate():
            with torch.no_grad():
                return model.generate(
                    prompts,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                    **options,
                )

        return generate

    row["mode"] = "eager, default cache"
    options = {}
    if dev.type == "cuda":
        try:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            options = dict(cache_implementation="static")
            sync(call(2, **options)())
            row["mode"] = "static cache, torch.compile"
        except Exception as err:  # noqa: BLE001 - any compile failure falls back to eager, said in the row
            model.forward = model.__class__.forward.__get__(model)
            options = {}
            row["compile_error"] = str(err).splitlines()[0][:200]
    row["generate_s"] = timed(call(args.new, **options), sync, args.samples, f"generate {args.new} tokens")
    row["prefill_s"] = timed(call(1, **options), sync, args.samples, "generate 1 token")
    if dev.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def child(args):
    """One row, printed as JSON for the driver."""
    if args.child == BANDWIDTH_ROW:
        row = run_read_bandwidth()
    else:
        framework, model_name, batch = args.child.split(":")
        run = {"ours": run_ours, "transformers": run_transformers, "long-tail": run_long_tail}[framework]
        try:
            row = dict(run(model_name, int(batch), args), status="ok")
        except Exception as err:  # noqa: BLE001 - OOM and compile failures are results here
            text = str(err)
            oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
            row = dict(
                framework=framework,
                model=model_name,
                batch=int(batch),
                status=("OOM: " if oom else "error: ") + text.splitlines()[0][:200],
            )
    print("JMM_BENCH_ROW " + json.dumps(row))


def run_child(name, args):
    child_args = ["--child", name, "--prompt", str(args.prompt), "--new", str(args.new), "--samples", str(args.samples)]
    child_args += ["--prompts", str(args.prompts)]
    print(f"{name}:", file=sys.stderr, flush=True)  # the child's progress lines follow
    row, crash = benchmarks.run_child("benchmarks.bench_generate", child_args, "JMM_BENCH_ROW ")
    return row if row is not None else dict(child=name, status=crash)


def with_rates(row, args, bandwidth_gbs):
    """`row` with tokens/s, the decode step's time, its floor and the step's multiple of it (long-tail rows: the
    tokens/s of static and continuous batching)."""
    if row.get("status") != "ok":
        return row
    if row.get("workload") == "long-tail":
        row["static_tokens_per_s"] = row["tokens"] / row["static_s"]
        row["continuous_tokens_per_s"] = row["tokens"] / row["continuous_s"]
        return row
    batch = row["batch"]
    row["tokens_per_s"] = batch * args.new / row["generate_s"]
    row["step_ms"] = (row["generate_s"] - row["prefill_s"]) / max(args.new - 1, 1) * 1e3
    config = model_config(row["model"])
    row["floor_ms"] = step_floor_bytes(config, batch, args.prompt + args.new / 2) / bandwidth_gbs / 1e6
    row["step_over_floor"] = row["step_ms"] / row["floor_ms"]
    return row


def table(rows, bandwidth_gbs):
    lines = [
        f"read bandwidth in this run: {bandwidth_gbs:.0f} GB/s",
        f"{'framework':<14}{'model':<12}{'batch':>6}{'tokens/s':>11}{'step ms':>10}{'floor ms':>10}{'x floor':>10}"
        f"{'vs transformers':>17}  mode / status",
    ]
    peers = {(r["model"], r["batch"]): r for r in rows if r.get("framework") == "transformers" and "tokens_per_s" in r}
    for r in rows:
        if "framework" not in r:
            continue
        if r.get("workload") == "long-tail" and r.get("status") == "ok":
            lines.append(
                f"{'long-tail':<14}{r['model']:<12}{r['batch']:>6}  {r['tokens']} tokens: static batches "
                f"{r['static_tokens_per_s']:.0f} tokens/s, continuous {r['continuous_tokens_per_s']:.0f} tokens/s "
                f"({r['static_s'] / r['continuous_s']:.2f}x)"
            )
            continue
        head = f"{r['framework']:<14}{r['model']:<12}{r['batch']:>6}"
        if r.get("status") != "ok":
            lines.append(f"{head}{'':>58}  {r.get('status')}")
            continue
        peer = peers.get((r["model"], r["batch"]))
        ratio = f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer and r is not peer else ""
        lines.append(
            f"{head}{r['tokens_per_s']:>11.0f}{r['step_ms']:>10.2f}{r['floor_ms']:>10.3f}"
            f"{r['step_over_floor']:>10.1f}{ratio:>17}  {r.get('mode', '')}"
        )
    return "\n".join(lines)


def main():
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=benchmarks.comma_list(MODELS), default=["q30-4layer", "q30"])
    parser.add_argument("--batches", type=benchmarks.comma_list(None, int), default=list(BATCHES))
    parser.add_argument("--frameworks", type=benchmarks.comma_list(FRAMEWORKS), default=list(FRAMEWORKS))
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--new", type=int, default=256, help="generated tokens per sequence")
    parser.add_argument("--samples", type=int, default=5, help="timed calls per measurement (median)")
    parser.add_argument(
        "--workload",
        choices=("batch", "long-tail"),
        default="batch",
        help="batch: every prompt generates --new tokens, the rows above; long-tail: --prompts prompts of "
        "long-tailed budgets (exponential, mean --new / 4, at most --new) through each --batches value of rows, "
        "static batches against continuous batching",
    )
    parser.add_argument("--prompts", type=int, default=64, help="prompts of the long-tail workload")
    parser.add_argument("--json", default="bench_generate.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.new < 2 or args.prompt < 1:
        parser.error(f"--new must be at least 2 and --prompt at least 1, got {args.new} and {args.prompt}")
    bandwidth = run_child(BANDWIDTH_ROW, args)
    bandwidth_gbs = bandwidth["gb_per_s"] if bandwidth.get("status") == "ok" else float("nan")
    rows = [bandwidth]
    frameworks = args.frameworks if args.workload == "batch" else ["long-tail"]
    for model_name in args.models:
        for batch in args.batches:
            for framework in frameworks:
                rows.append(with_rates(run_child(f"{framework}:{model_name}:{batch}", args), args, bandwidth_gbs))
                print(json.dumps(rows[-1]), flush=True)
                with open(args.json, "w") as f:  # after every row, so a run cut short keeps its rows
                    json.dump(dict(rows=rows, read_gb_per_s=bandwidth_gbs, argv=sys.argv), f, indent=1)
    print(table(rows, bandwidth_gbs))


if __name__ == "__main__":
    cli.run(main)
