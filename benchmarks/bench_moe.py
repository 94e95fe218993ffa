"""MoE layer benchmark on one GPU: jax_megamoe's CUDA kernels against the peers, in one run.

Implementations: `ours` (jax_megamoe.moe_ffn, implementation="cuda"), `torch_grouped_mm` (torchtitan style:
stable sort + torch._grouped_mm + index_add scatter), `ragged_dot` (sort + jax.lax.ragged_dot),
`gshard` (capacity-factor-1.0 dispatch/combine einsums), `tokamax` (tokamax.ragged_dot with its Mosaic GPU
kernel, pinned so that no silent fallback to XLA is timed; only if importable: packages missing from the
image can be put in the folder named by JMM_PEER_SITE, a site directory after the environment's own, so the
image's own packages win),
`ours_tiles_<spec>`: `ours` with an explicit `jmm.GemmConfig` passed as `moe_ffn(..., gemm_config=...)`: <spec>
is one `jax_megamoe.GemmTiles` member name for every row-grouped GEMM (`ours_tiles_coop_128x256`), or
`<gemm>=<member>` pairs joined by '+' (`ours_tiles_fwd_down=coop_128x256+bwd_down=coop_128x256`; <gemm>: fwd_gate_up,
fwd_down, bwd_down, bwd_gate_up), the GEMMs not named keeping the heuristic's tiles for the config's shape
(`GemmConfig.for_problem`), to compare GEMM tile configurations in one run,
`ours_fp8`: `ours` with `recipe="fp8_blockwise"` (FP8 blockwise GEMMs, docs/fp8.md), `torch_fp8_rowwise`:
`torch_grouped_mm` with torchao's FP8 rowwise recipe on `torch._scaled_grouped_mm` (its quantisers
`torch.compile`d),
and `ours_graphs`: `ours` with XLA recording the custom calls into CUDA graphs (command buffers; XLA_FLAGS of
GRAPH_XLA_FLAGS set for its subprocess), which XLA does not do for custom calls by default.
Configs (bf16): q30 (T=16384, H=2048, I=768, E=128, K=8), q235 (H=4096, I=1536), q30s (T=2048), and `tiny`
(a CPU smoke size); the decode sizes `q30-t<T>` and `q235-t<T>` (T = 8, 64, 256, 512: one decode step of a batch of
T sequences); uniform and Zipf-skewed routing. Decode sizes are bound by reading the experts' weights, not by
FLOPs: each of their rows has a floor, the bytes the call must move (the weights of every expert the routing
touches, counted in the row's own routing, plus x and y) over the GPU's read bandwidth measured in the same run
(a float32 sum over a 4 GiB bf16 buffer), and its forward's distance to that floor (`x floor`).
Variants: `plain` (router excluded, as published
fused-MoE numbers are taken), `router` (the router inside the timed call: logits GEMM, float32 softmax, top-k and
renormalisation, differentiated into its weight; the same routing code for every implementation) and `remat`
(the MoE under jax.checkpoint, torch.utils.checkpoint for torch: the backward recomputes the forward, as
activation-checkpointed training runs it).
Reports forward and forward+backward time (median over samples of back-to-back calls, after warm-up; each
sample is synchronised once, so the time is device time whenever the device is the bottleneck), peak device
memory, effective TF/s (6*T*K*H*I per forward, 3x that for forward+backward: the experts' FLOPs only, in every
variant) and the fraction of a bf16 matmul (torch, 8192^3) measured in the same run.

Peak memory (`peak_gib`) is that of the inputs plus ONE synchronised forward+backward call, measured before
any timing: the timing loops keep several calls in flight, and JAX frees a call's outputs only when it
completes, so a peak read after them counts two sets of weight gradients for JAX and one for torch. Every
row (implementation, config, routing) runs in its own subprocess, so its peak is its own; `peak_by_call`
says whether the call set it (False: input creation or compilation went higher, and `peak_gib` is that;
None: no memory statistics, e.g. on a CPU).
Usage: python -m benchmarks.bench_moe [--configs q30s,q30,q235 | q30-t8,q30-t64,...] [--impls ...]
                                     [--variants plain,router,remat] [--json F] [--png F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.moe_bench.children import child, run_child
from benchmarks.moe_bench.device_rates import BANDWIDTH_ROW, MATMUL_ROW
from benchmarks.moe_bench.impls import IMPLS, SKIP
from benchmarks.moe_bench.plot import plot
from benchmarks.moe_bench.rates import with_rates
from benchmarks.moe_bench.report import table
from benchmarks.moe_bench.shapes import CONFIGS, ROUTINGS, VARIANTS, is_decode_config
from jax_megamoe import cli  # the command-line jobs' exit-code rule


def main():
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="q30s,q30,q235")
    parser.add_argument("--routings", default="uniform,zipf")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--variants", default="plain", help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--json", default="bench_moe.json")
    parser.add_argument("--png", default="bench_moe.png")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    configs, routings, variants = args.configs.split(","), args.routings.split(","), args.variants.split(",")
    for flag, given, known in (
        ("--configs", configs, CONFIGS),
        ("--routings", routings, ROUTINGS),
        ("--variants", variants, VARIANTS),
    ):
        unknown = [v for v in given if v not in known]
        if unknown:
            parser.error(f"{flag}: unknown {unknown}; known: {sorted(known)}")
    matmul = run_child(MATMUL_ROW)
    matmul_tfs = matmul["tflops"] if matmul.get("status") == "ok" else float("nan")
    rows = [matmul]
    bandwidth_gbs = float("nan")
    if any(is_decode_config(c) for c in configs):
        bandwidth = run_child(BANDWIDTH_ROW)
        bandwidth_gbs = bandwidth["gb_per_s"] if bandwidth.get("status") == "ok" else float("nan")
        rows.append(bandwidth)
    for impl in args.impls.split(","):
        start = time.perf_counter()
        for cname in configs:
            for routing in routings:
                for variant in variants:
                    if (impl, cname) in SKIP:
                        rows.append(
                            dict(impl=impl, config=cname, routing=routing, variant=variant, status=SKIP[(impl, cname)])
                        )
                    else:
                        row = run_child(impl, cname, routing, variant, args.samples, args.inner)
                        rows.append(with_rates(row, matmul_tfs, bandwidth_gbs))
        print(f"[{impl}: {time.perf_counter() - start:.0f} s]", flush=True)
        with open(args.json, "w") as f:  # after every implementation, so a run cut short keeps its rows
            json.dump(
                dict(rows=rows, matmul_tflops=matmul_tfs, read_gb_per_s=bandwidth_gbs, configs=CONFIGS, argv=sys.argv),
                f,
                indent=1,
            )
    plot(rows, args.png)
    print(table(rows, matmul_tfs, bandwidth_gbs))


if __name__ == "__main__":
    cli.run(main)
