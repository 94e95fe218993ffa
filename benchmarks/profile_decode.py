"""Where one decode step of `qwen3_moe.generate` spends its GPU time: per-kernel device time by part of the model.

Runs one greedy `generate` call (bf16, random weights, `--batch` prompts of `--prompt` tokens, `--new` new tokens)
under `jax.profiler.trace`, reads the trace's GPU kernels (`ProfileData`), and maps each kernel to the HLO
instruction that launched it and that instruction's named scope (the optimized HLO, dumped by XLA for this process):
`attention` (the attention block: norms of q and k, projections, RoPE, the cache write, attention over the cache),
`moe` (router and experts), `lm_head`, `sampling` (the token's choice and its log-prob) and `rest` (embedding,
residual adds, layer norms, the loop's bookkeeping). Only kernels of the decode loop's body (`decode_step`) count; the
totals are divided by the loop's iterations (`--new` - 1), so they are one step's. XLA's command buffers are off
here, so each kernel is its own event; the sum of kernel times is the step's device time without launch gaps.

Usage: python -m benchmarks.profile_decode [--model q30-4layer] [--batch 64] [--prompt 512] [--new 32] [--json F]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile

PARTS = ("attention", "moe", "lm_head", "sampling")
DUMP = tempfile.mkdtemp(prefix="jmm_profile_decode_hlo_")


def hlo_scopes(dump_dir: str) -> dict[tuple[str, str], str]:
    """`(module name, instruction name) -> op_name` from XLA's optimized HLO dumps; a fusion without metadata of
    its own takes its fused computation's root's."""
    scopes: dict[tuple[str, str], str] = {}
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        module = re.sub(r"^module_\d+\.", "", os.path.basename(path)).split(".")[0]
        op_names: dict[str, str] = {}
        calls: dict[str, str] = {}
        roots: dict[str, str] = {}
        computation = ""
        with open(path) as f:
            for line in f:
                if not line[:1].isspace():
                    if line.rstrip().endswith("{"):
                        computation = re.sub(r"^(ENTRY\s+)?%?", "", line).split(" ")[0]
                    continue
                head = re.match(r"\s*(ROOT\s+)?%?([\w.\-]+) = ", line)
                if head is None:
                    continue
                name = head.group(2)
                found = re.search(r'op_name="([^"]*)"', line)
                op_names[name] = found.group(1) if found else ""
                if called := re.search(r"calls=%?([\w.\-]+)", line):
                    calls[name] = called.group(1)
                if head.group(1):
                    roots[computation] = op_names[name]
        for name, op_name in op_names.items():
            scopes[(module, name)] = op_name or roots.get(calls.get(name, ""), "")
    return scopes


def part_of(op_name: str) -> str:
    for part in PARTS:
        if f"/{part}/" in f"/{op_name}/":
            return part
    return "rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="q30-4layer", choices=("tiny", "q30-4layer", "q30"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--json", default="profile_decode.json")
    args = parser.parse_args()
    if args.new < 2:
        parser.error("--new must be at least 2 (the decode loop runs --new - 1 steps)")
    flags = f"--xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_gpu_enable_command_buffer="
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax._src.lib import _profile_data

    from benchmarks.bench_generate import model_config
    from jax_megamoe.models import qwen3_moe

    config = model_config(args.model)
    model = nnx.jit(
        lambda: qwen3_moe.Qwen3MoeForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )()
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(0, config.vocab_size, (args.batch, args.prompt), dtype=np.int32))

    def call():
        return qwen3_moe.generate(model, prompts, max_new_tokens=args.new, temperature=0.0).tokens

    jax.block_until_ready(call())
    jax.block_until_ready(call())
    trace_dir = tempfile.mkdtemp(prefix="jmm_profile_decode_trace_")
    with jax.profiler.trace(trace_dir):
        jax.block_until_ready(call())
    [xplane] = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    scopes = hlo_scopes(DUMP)
    steps = args.new - 1
    per_part: dict[str, float] = collections.defaultdict(float)
    per_kernel: dict[tuple[str, str], list] = {}
    unmapped = 0
    planes = list(_profile_data.ProfileData.from_file(xplane).planes)
    device = "/device:GPU" if any(p.name.startswith("/device:GPU") for p in planes) else "/host:CPU"
    for plane in planes:
        if not plane.name.startswith(device):
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op, module = str(stats.get("hlo_op", "")), str(stats.get("hlo_module", ""))
                if not op:
                    continue
                op_name = scopes.get((module, op))
                if op_name is None:
                    unmapped += 1
                    op_name = ""
                if "/decode_step/" not in f"/{op_name}/":
                    continue  # prefill, the first token, the loop's condition
                part = part_of(op_name)
                us = event.duration_ns / 1e3 / steps
                per_part[part] += us
                entry = per_kernel.setdefault((part, event.name), [0.0, 0])
                entry[0] += us
                entry[1] += 1
    total = sum(per_part.values())
    print(f"{args.model}, batch {args.batch}, prompt {args.prompt}: one decode step's {device} ops, {total:.1f} us")
    for part in (*PARTS, "rest"):
        us = per_part.get(part, 0.0)
        print(f"  {part:<10} {us:9.1f} us  {100 * us / max(total, 1e-9):5.1f}%")
    print("largest kernels (us per step, launches per step):")
    for (part, name), (us, count) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {us:9.1f} {count / steps:5.1f}  {part:<10} {name[:110]}")
    if unmapped:
        print(f"{unmapped} kernel events named an HLO instruction missing from the dumps (counted as rest)")
    with open(args.json, "w") as f:
        json.dump(
            dict(
                argv=sys.argv,
                device=jax.devices()[0].device_kind,
                step_kernels_us=total,
                parts_us=dict(per_part),
                kernels=[
                    dict(part=part, name=name, us_per_step=us, launches_per_step=count / steps)
                    for (part, name), (us, count) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
                ],
            ),
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
