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
import math
import os
import statistics
import sys
import time

import benchmarks
from jax_megamoe import cli  # the command-line jobs' exit-code rule

DECODE_TOKENS = (8, 64, 256, 512)  # one decode step's batch
CONFIGS = {  # name: (T, H, I, E, K), in ascending memory order
    "tiny": (64, 128, 64, 8, 2),  # the CPU smoke test's size
    **{f"q30-t{t}": (t, 2048, 768, 128, 8) for t in DECODE_TOKENS},
    "q30s": (2048, 2048, 768, 128, 8),
    "q30": (16384, 2048, 768, 128, 8),
    **{f"q235-t{t}": (t, 4096, 1536, 128, 8) for t in DECODE_TOKENS},
    "q235": (16384, 4096, 1536, 128, 8),
}
BANDWIDTH_ROW = "read_bandwidth"  # the driver's child that measures the GPU's read bandwidth
IMPLS = ("ours", "torch_grouped_mm", "ragged_dot", "gshard", "tokamax")
TILES_PREFIX = "ours_tiles_"  # + a GemmTiles member, or gemm=member pairs joined by '+' (commas separate --impls)
GEMMS = ("fwd_gate_up", "fwd_down", "bwd_down", "bwd_gate_up")  # GemmConfig's fields
GRAPHS_IMPL = "ours_graphs"
FP8_IMPL = "ours_fp8"  # moe_ffn(..., recipe="fp8_blockwise") on the CUDA kernels, bf16 x and weights
GRAPH_XLA_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
ROUTINGS = ("uniform", "zipf")
VARIANTS = ("plain", "router", "remat")
# Peers known to be hopeless at a size are not run there (measured once): recorded as skipped.
SKIP = {
    ("gshard", "q235"): "not run: dense capacity einsum at q235 takes minutes of device time",
    ("ragged_dot", "q235"): "not run: already out of memory at q30 (dense expansion)",
}


def flops_forward(t, h, i, e, k):
    return 6 * t * k * h * i


def is_decode_config(cname):
    return "-t" in cname


def floor_bytes(shape, experts_touched):
    """The bytes a forward must move at least: the weights of the experts the routing touches (gate/up and
    down, bf16), x read and y written."""
    t, h, i, _, _ = shape
    return experts_touched * 3 * h * i * 2 + 2 * t * h * 2


def is_tiles_impl(impl):
    return impl.startswith(TILES_PREFIX)


def gemm_config(impl, shape):
    """The explicit `jmm.GemmConfig` of an `ours_tiles_<spec>` implementation name for a problem of `shape`
    (T, H, I, E, K), or None for any other name (moe_ffn's heuristic)."""
    if not is_tiles_impl(impl):
        return None
    import dataclasses

    from jax_megamoe import GemmConfig, GemmTiles

    spec = impl[len(TILES_PREFIX) :]
    if not spec:
        raise ValueError(f"impl {impl!r}: expected {TILES_PREFIX}<GemmTiles member or gemm=member pairs>, got nothing")

    def tiles(name):
        try:
            return GemmTiles[name.upper()]
        except KeyError:
            raise ValueError(
                f"impl {impl!r}: unknown tiles {name!r}; GemmTiles has {[t.name.lower() for t in GemmTiles]}"
            ) from None

    t, h, i, e, k = shape
    heuristic = GemmConfig.for_problem(t, k, h, i, e)
    if "=" not in spec:
        return GemmConfig(**dict.fromkeys(GEMMS, tiles(spec)))
    chosen = {}
    for part in spec.split("+"):
        gemm, _, name = part.partition("=")
        if gemm not in GEMMS or gemm in chosen:
            raise ValueError(f"impl {impl!r}: {gemm!r} is not one of {GEMMS} (each once)")
        chosen[gemm] = tiles(name)
    return dataclasses.replace(heuristic, **chosen)


# ----------------------------------------------------------------------------------------------- JAX side


def log_prior(e, routing, xp):
    """Log-probabilities of the experts before noise: flat, or Zipf-like (`xp`: numpy, jax.numpy or torch)."""
    if routing == "uniform":
        return xp.zeros(e)
    return -1.2 * xp.log1p(xp.arange(e, dtype=xp.float32))


def jax_routing(t, e, k, routing, seed):
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    experts = jax.lax.top_k(log_prior(e, routing, jnp) + jax.random.gumbel(k1, (t, e)), k)[1].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(k2, (t, k)), axis=-1)
    return weights, experts


def jax_variant(moe, variant, top_k):
    """The timed forward `f(x, r1, r2, gu, d)` of `variant`. `plain`: moe itself, (r1, r2) = (weights, experts).
    `remat`: the same under jax.checkpoint. `router`: (r1, r2) = (w_router [H, E], logit_bias [E]), routed inside by
    jax_megamoe.route (what every JAX implementation here would call), so r1 gets the router's gradient."""
    import jax
    import jax.numpy as jnp

    if variant == "plain":
        return moe
    if variant == "remat":
        return jax.checkpoint(moe)
    if variant == "router":
        from jax_megamoe import route

        def routed(x, w_router, logit_bias, gu, d):
            logits = jnp.dot(x, w_router, preferred_element_type=jnp.float32) + logit_bias
            weights, experts = route(logits, top_k, norm_topk_prob=True)
            return moe(x, weights, experts, gu, d)

        return routed
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")


def jax_impl(name, shape=None):
    """The MoE function of implementation `name`; `shape` (T, H, I, E, K) gives `ours_tiles_*` their config."""
    import jax
    import jax.numpy as jnp

    if name == FP8_IMPL:
        import jax_megamoe as jmm

        return lambda x, w, ids, gu, d: jmm.moe_ffn(x, w, ids, gu, d, implementation="cuda", recipe="fp8_blockwise")
    if name in ("ours", GRAPHS_IMPL) or is_tiles_impl(name):
        import jax_megamoe as jmm  # graphs come from XLA_FLAGS, set for the child by child_env()

        config = gemm_config(name, shape)
        return lambda x, w, ids, gu, d: jmm.moe_ffn(x, w, ids, gu, d, implementation="cuda", gemm_config=config)

    from jax_megamoe.reference import swiglu

    if name in ("ragged_dot", "tokamax"):
        if name == "tokamax":
            import tokamax

            def ragged(a, b, s):
                return tokamax.ragged_dot(a, b, s, implementation="mosaic")
        else:
            ragged = jax.lax.ragged_dot

        def moe(x, w, ids, gu, d):
            t, k = ids.shape
            e = gu.shape[0]
            flat = ids.reshape(-1)
            order = jnp.argsort(flat, stable=True)
            sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
            xs = x[order // k]
            out = ragged(swiglu(ragged(xs, gu, sizes)), d, sizes)
            out = out.astype(jnp.float32) * w.reshape(-1)[order][:, None]
            return jnp.zeros((t, x.shape[1]), jnp.float32).at[order // k].add(out).astype(x.dtype)

        return moe

    if name == "gshard":

        def moe(x, w, ids, gu, d):
            t, k = ids.shape
            e = gu.shape[0]
            cap = math.ceil(t * k / e)  # capacity factor 1.0
            onehot = jax.nn.one_hot(ids, e, dtype=jnp.int32)  # [T, K, E]
            pos = jnp.cumsum(onehot.reshape(t * k, e), axis=0).reshape(t, k, e) - 1
            pos = jnp.sum(pos * onehot, axis=-1)  # [T, K]
            keep = (pos < cap).astype(x.dtype)
            dispatch = sum(
                jax.nn.one_hot(ids[:, j], e, dtype=x.dtype)[:, :, None]
                * (jax.nn.one_hot(pos[:, j], cap, dtype=x.dtype) * keep[:, j, None])[:, None, :]
                for j in range(k)
            )  # [T, E, C]
            combine = sum(
                jax.nn.one_hot(ids[:, j], e, dtype=x.dtype)[:, :, None]
                * (jax.nn.one_hot(pos[:, j], cap, dtype=x.dtype) * (keep[:, j] * w[:, j]).astype(x.dtype)[:, None])[
                    :, None, :
                ]
                for j in range(k)
            )
            xe = jnp.einsum("tec,th->ech", dispatch, x)
            he = swiglu(jnp.einsum("ech,ehi->eci", xe, gu))
            oe = jnp.einsum("eci,eih->ech", he, d)
            return jnp.einsum("tec,ech->th", combine, oe)

        return moe
    raise ValueError(name)


def time_calls(fn, args, sync, samples, inner):
    """Median per-call ms over `samples` syncs of `inner` back-to-back calls, after warm-up."""
    for _ in range(3):
        sync(fn(*args))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        sync(out)
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times), min(times)


def forward_and_gradients(moe):
    """`(y, gradients)` of `moe` for (x, r1, gu, d): y is returned because a training step uses it, and a jitted
    gradient alone would let XLA drop the first forward of `remat` (nothing of it is saved) and time one."""
    import jax

    def fwd_bwd(x, r1, r2, gu, d, dy):
        y, vjp = jax.vjp(lambda a, b, c, f: moe(a, b, r2, c, f), x, r1, gu, d)
        return y, vjp(dy)

    return fwd_bwd


def run_jax(name, cname, routing, variant, samples, inner):
    import jax
    import jax.numpy as jnp

    row = dict(impl=name, config=cname, routing=routing, variant=variant)
    if name == "tokamax":
        benchmarks.add_peer_site(os.environ.get("JMM_PEER_SITE"))
        # tokamax's absl flags parse sys.argv and refuse this child's own (already parsed) arguments.
        sys.argv = sys.argv[:1]
        try:
            import tokamax  # noqa: F401
        except Exception as err:  # noqa: BLE001 - any import failure means the peer is unavailable
            return dict(row, status=f"skipped: tokamax not importable ({err!r})")
    t, h, i, e, k = CONFIGS[cname]
    moe = jax_variant(jax_impl(name, CONFIGS[cname]), variant, k)

    def peak_bytes():  # without memory statistics (a CPU) the peak is NaN
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", float("nan"))

    try:
        keys = jax.random.split(jax.random.PRNGKey(7), 5)
        x = jax.random.normal(keys[0], (t, h), jnp.bfloat16)
        gu = (jax.random.normal(keys[1], (e, h, 2 * i), jnp.bfloat16) / math.sqrt(h)).astype(jnp.bfloat16)
        d = (jax.random.normal(keys[2], (e, i, h), jnp.bfloat16) / math.sqrt(i)).astype(jnp.bfloat16)
        dy = jax.random.normal(keys[3], (t, h), jnp.bfloat16)
        if variant == "router":
            r1 = (jax.random.normal(keys[4], (h, e), jnp.bfloat16) / math.sqrt(h)).astype(jnp.bfloat16)
            r2 = log_prior(e, routing, jnp)
        else:
            r1, r2 = jax_routing(t, e, k, routing, seed=11)
        # The experts this row's routing touches (for `router`, the top-k of its logits: its routed ids).
        ids = r2 if variant != "router" else jax.lax.top_k(x.astype(jnp.float32) @ r1.astype(jnp.float32) + r2, k)[1]
        row["experts_touched"] = int(jnp.unique(ids).size)
        sync = jax.block_until_ready
        fwd = jax.jit(moe)
        fwd_bwd = jax.jit(forward_and_gradients(moe)).lower(x, r1, r2, gu, d, dy).compile()
        before = peak_bytes()
        sync(fwd_bwd(x, r1, r2, gu, d, dy))
        peak = peak_bytes()
        row.update(peak_gib=peak / 2**30, peak_by_call=bool(peak > before) if math.isfinite(peak) else None)
        row["fwd_ms"], row["fwd_min_ms"] = time_calls(fwd, (x, r1, r2, gu, d), sync, samples, inner)
        row["fwd_bwd_ms"], row["fwd_bwd_min_ms"] = time_calls(fwd_bwd, (x, r1, r2, gu, d, dy), sync, samples, inner)
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - OOM and compile failures are results here
        msg = str(err).splitlines()[0][:200]
        row["status"] = (
            "OOM: " if "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower() else "error: "
        ) + msg
    return row


# --------------------------------------------------------------------------------------------- torch side


def run_matmul():
    """The bf16 matmul rate (8192^3, torch) of this GPU, the base of every row's "%mm"."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms, _ = time_calls(torch.matmul, (a, b), lambda _: torch.cuda.synchronize(), 10, 10)
    return dict(impl="bf16_matmul_8192", status="ok", tflops=2 * 8192**3 / mm_ms / 1e9, ms=mm_ms)


def run_read_bandwidth():
    """The device's read bandwidth: a float32 sum over a bf16 buffer (JAX; 4 GiB on a GPU, 256 MiB on a CPU,
    where it only keeps the smoke tests small), the base of every decode row's floor."""
    import jax
    import jax.numpy as jnp

    elements = 1 << (31 if jax.devices()[0].platform == "gpu" else 27)
    a = jnp.ones((elements,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    ms, _ = time_calls(total, (a,), jax.block_until_ready, 10, 10)
    return dict(impl=BANDWIDTH_ROW, status="ok", gb_per_s=a.nbytes / ms / 1e6, ms=ms, bytes=a.nbytes)


def torch_variant(moe, variant, top_k):
    """jax_variant's `f(x, r1, r2, gu, d)` for torch: the router is the same math, checkpointing is torch's."""
    import torch

    if variant == "plain":
        return moe
    if variant == "remat":
        return lambda *args: torch.utils.checkpoint.checkpoint(moe, *args, use_reentrant=False)
    if variant == "router":

        def routed(x, w_router, logit_bias, gu, d):
            probs = torch.softmax((x @ w_router).float() + logit_bias, dim=-1)
            weights, experts = torch.topk(probs, top_k, dim=-1)
            return moe(x, weights / weights.sum(dim=-1, keepdim=True), experts, gu, d)

        return routed
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")


def torch_fp8_grouped_mm():
    """torchao's FP8 rowwise MoE GEMM (`_Float8GroupedMM`'s recipe) on torch 2.11's `torch._scaled_grouped_mm`:
    `a [M, K] @ b[e] [K, N]` for the rows of each group in `offs`, forward and backward, e4m3 operands with one
    float32 scale (amax / 448) per row of a and per output column of each expert's b; the weight gradient's operands
    with one scale per column per group, along the tokens. Every group's rows start at a multiple of 16 (`torch_moe`'s
    `align`), as the weight gradient's kernel requires. The quantisers are `torch.compile`d (fused)."""
    import torch

    def rowwise(a):  # one scale per slice along the last dimension
        amax = a.abs().amax(dim=-1, keepdim=True).float()
        scale = torch.where(amax > 0, amax / 448.0, 1.0)
        return (a.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale.squeeze(-1)

    def per_group_columns(a, offs):  # a [M, C] -> values [C, M] (token-contiguous), scales [groups * C]
        group = torch.searchsorted(offs, torch.arange(a.shape[0], device=a.device, dtype=offs.dtype), right=True)
        group = group.clamp(max=offs.shape[0] - 1)
        # the groups are whole 16-row tiles: the tiles' column maxima, then a segmented max over each group's tiles
        tiles = a.abs().float().reshape(-1, 16, a.shape[1]).amax(dim=1)
        ends = torch.cat([offs, offs.new_full((1,), a.shape[0])]) // 16  # the rows past the last group: a last one
        sizes = torch.diff(ends, prepend=ends.new_zeros(1))
        amax = torch.segment_reduce(tiles, "max", lengths=sizes, axis=0, unsafe=True, initial=0.0)[:-1]
        scale = torch.where(amax > 0, amax / 448.0, 1.0)
        values = (a.float() / scale[group]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return values.t().contiguous(), scale.reshape(-1)

    rowwise, per_group_columns = torch.compile(rowwise), torch.compile(per_group_columns)

    def mm(a, sa, b, sb, offs):
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)

    class Fp8GroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, offs):
            ctx.save_for_backward(a, b, offs)
            qa, sa = rowwise(a)
            qb, sb = rowwise(b.transpose(-2, -1).contiguous())  # [E, N, K]: K-major
            return mm(qa, sa, qb.transpose(-2, -1), sb, offs)

        @staticmethod
        def backward(ctx, dout):
            a, b, offs = ctx.saved_tensors
            qd, sd = rowwise(dout)
            qb, sb = rowwise(b)  # [E, K, N]: N-major, the contraction of da = dout . b^T
            da = mm(qd, sd, qb.transpose(-2, -1), sb, offs)
            qdt, sdt = per_group_columns(dout, offs)  # [N, M]
            qat, sat = per_group_columns(a, offs)  # [K, M]
            db = mm(qdt, sdt, qat.t(), sat, offs)  # [E, N, K]
            return da, db.transpose(-2, -1), None

    return Fp8GroupedMM.apply


def torch_moe(grouped_mm, align=1):
    """torchtitan's MoE experts with `grouped_mm(a, b, offs)`: stable sort by expert, two grouped GEMMs, weighted
    index_add scatter. With `align` > 1 each expert's rows start at a multiple of `align`, zero rows between
    (torchtitan's padding for the FP8 grouped GEMMs, whose weight gradient needs groups of whole 16-row tiles)."""
    import torch
    import torch.nn.functional as F

    def moe(x, w, ids, gu, d):
        t, k = ids.shape
        e = gu.shape[0]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e)
        token = order // k
        if align > 1:
            padded = (counts + align - 1) // align * align
            offs = torch.cumsum(padded, 0).to(torch.int32)
            expert = flat[order]
            rank = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
            dest = (offs - padded)[expert] + rank
            capacity = -(-(flat.numel() + (align - 1) * e) // align) * align
            source = torch.full((capacity,), t, device=x.device).index_put((dest,), token)
            rows = torch.cat([x, x.new_zeros(1, x.shape[1])])[source]  # the padding rows: row t, zeros
        else:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            rows = x[token]
        z = grouped_mm(rows, gu, offs)
        g, u = z.chunk(2, dim=-1)
        out = grouped_mm(F.silu(g) * u, d, offs)
        if align > 1:
            out = out[dest]
        out = out * w.reshape(-1)[order].to(out.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, token, out)

    return moe


def torch_bf16_grouped_mm():
    import torch

    return lambda a, b, offs: torch._grouped_mm(a, b, offs=offs)


TORCH_IMPLS = {  # name: a maker of the experts' grouped GEMM, and the row alignment of its groups
    "torch_grouped_mm": (torch_bf16_grouped_mm, 1),
    "torch_fp8_rowwise": (torch_fp8_grouped_mm, 16),
}


def run_torch(impl, cname, routing, variant, samples, inner):
    import torch
    import torch.utils.checkpoint  # noqa: F401 - torch_variant's remat

    dev = torch.device("cuda")

    def sync(_):
        torch.cuda.synchronize()

    row = dict(impl=impl, config=cname, routing=routing, variant=variant)
    t, h, i, e, k = CONFIGS[cname]
    make, align = TORCH_IMPLS[impl]
    moe = torch_variant(torch_moe(make(), align), variant, k)
    try:
        gen = torch.Generator(device=dev).manual_seed(3)
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
        gu = torch.randn(e, h, 2 * i, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(h)
        d = torch.randn(e, i, h, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(i)
        dy = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
        log_p = log_prior(e, routing, torch).to(dev)
        if variant == "router":
            r1 = torch.randn(h, e, device=dev, dtype=torch.bfloat16, generator=gen) / math.sqrt(h)
            r2 = log_p
        else:
            gumbel = -torch.log(-torch.log(torch.rand(t, e, device=dev, generator=gen)))
            r2 = torch.topk(log_p + gumbel, k, dim=-1).indices
            r1 = torch.softmax(torch.randn(t, k, device=dev, generator=gen), dim=-1)
        ids = r2 if variant != "router" else torch.topk(x.float() @ r1.float() + r2, k, dim=-1).indices
        row["experts_touched"] = int(torch.unique(ids).numel())
        params = [p.requires_grad_() for p in (x, r1, gu, d)]

        def fwd(x, r1, gu, d):
            with torch.no_grad():
                return moe(x, r1, r2, gu, d)

        def fwd_bwd(x, r1, gu, d):
            y = moe(x, r1, r2, gu, d)
            return y, torch.autograd.grad(y, (x, r1, gu, d), dy)

        torch.cuda.reset_peak_memory_stats()  # the inputs stay counted: they are allocated
        first = fwd_bwd(*params)
        sync(first)
        row.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30, peak_by_call=True)
        if impl != "torch_grouped_mm":  # what it computes: normwise distance to the bf16 formulation's results
            bf16 = torch_variant(torch_moe(torch_bf16_grouped_mm()), variant, k)
            y = bf16(*params[:2], r2, *params[2:])
            ref = (y, *torch.autograd.grad(y, params, dy))
            names = ("y", "dx", "d_weights", "d_w_gate_up", "d_w_down")
            row["rel_err_vs_bf16"] = {}
            for name, a, b in zip(names, (first[0], *first[1]), ref, strict=True):
                a, b = a.detach().float(), b.detach().float()
                row["rel_err_vs_bf16"][name] = float((a - b).norm() / b.norm())
        del first
        row["fwd_ms"], row["fwd_min_ms"] = time_calls(fwd, params, sync, samples, inner)
        row["fwd_bwd_ms"], row["fwd_bwd_min_ms"] = time_calls(fwd_bwd, params, sync, samples, inner)
        row["status"] = "ok"
    except Exception as err:  # noqa: BLE001
        msg = str(err).splitlines()[0][:200]
        row["status"] = ("OOM: " if "out of memory" in msg.lower() else "error: ") + msg
    return row


# ------------------------------------------------------------------------------------------------ driver


def child(args):
    """One row (one config and routing given), or the matmul rate, printed as JSON for the driver."""
    if args.child == "bf16_matmul_8192":
        row = run_matmul()
    elif args.child == BANDWIDTH_ROW:
        row = run_read_bandwidth()
    elif args.child in TORCH_IMPLS:
        row = run_torch(args.child, args.configs, args.routings, args.variants, args.samples, args.inner)
    else:
        row = run_jax(args.child, args.configs, args.routings, args.variants, args.samples, args.inner)
    print("JMM_BENCH_ROW " + json.dumps(row))


def child_env(impl):
    """The environment of `impl`'s subprocess: this one's, plus GRAPH_XLA_FLAGS in XLA_FLAGS for `ours_graphs`
    (XLA reads them when its GPU client starts, so they cannot be set from inside the child)."""
    env = dict(os.environ)
    if impl == GRAPHS_IMPL:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + GRAPH_XLA_FLAGS).strip()
    return env


def run_child(impl, cname="all", routing="all", variant="all", samples=0, inner=0):
    """`child` in a subprocess of its own: its row, or a row saying how it crashed."""
    args = ["--child", impl, "--configs", cname, "--routings", routing, "--variants", variant]
    args += ["--samples", str(samples), "--inner", str(inner)]
    row, crash = benchmarks.run_child("benchmarks.bench_moe", args, "JMM_BENCH_ROW ", env=child_env(impl))
    return row if row is not None else dict(impl=impl, config=cname, routing=routing, variant=variant, status=crash)


def table(rows, matmul_tfs, bandwidth_gbs=float("nan")):
    w = max([18] + [len(r["impl"]) + 2 for r in rows if "config" in r])
    decode = any(is_decode_config(r["config"]) for r in rows if "config" in r)
    lines = [f"bf16 matmul (8192^3, torch) in this run: {matmul_tfs:.0f} TF/s"]
    if decode:
        lines.append(f"read bandwidth (float32 sum of 4 GiB bf16, JAX) in this run: {bandwidth_gbs:.0f} GB/s")
    floor_head = f"{'experts':>8}{'floor ms':>10}{'x floor':>8}" if decode else ""
    lines.append(
        f"{'impl':<{w}}{'config':<10}{'routing':<9}{'variant':<8}{'fwd ms':>9}{'TF/s':>7}{'%mm':>6}{floor_head}"
        f"{'f+b ms':>9}{'TF/s':>7}{'%mm':>6}{'peak GiB':>10}  status"
    )
    for r in rows:
        if "config" not in r:
            continue
        head = f"{r['impl']:<{w}}{r['config']:<10}{r['routing']:<9}{r['variant']:<8}"
        if r.get("status") != "ok":
            lines.append(f"{head}{'':>{54 + len(floor_head)}}  {r.get('status')}")
            continue
        floor = ""
        if decode:
            floor = (
                f"{r['experts_touched']:>8}{r['floor_ms']:>10.3f}{r['fwd_over_floor']:>8.2f}"
                if "floor_ms" in r
                else f"{'':>26}"
            )
        lines.append(
            f"{head}{r['fwd_ms']:>9.3f}{r['fwd_tflops']:>7.0f}{r['fwd_pct_matmul']:>6.0f}{floor}"
            f"{r['fwd_bwd_ms']:>9.3f}{r['fwd_bwd_tflops']:>7.0f}"
            f"{r['fwd_bwd_pct_matmul']:>6.0f}{r['peak_gib']:>10.2f}{'*' if r['peak_by_call'] is False else '':1} ok"
        )
    if any(r.get("status") == "ok" and r.get("peak_by_call") is False for r in rows):
        lines.append("* peak set before the call (input creation or compilation): the call's own peak is lower")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return
    ok = [r for r in rows if r.get("status") == "ok" and "config" in r]
    groups = sorted(
        {(r["config"], r["routing"], r["variant"]) for r in ok},
        key=lambda g: (list(CONFIGS).index(g[0]), g[1], VARIANTS.index(g[2])),
    )
    impls = list(dict.fromkeys(r["impl"] for r in ok))  # in run order
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, key, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "fwd_bwd_tflops", "forward+backward")):
        width = 0.8 / max(len(impls), 1)
        for j, impl in enumerate(impls):
            vals = [
                next((r[key] for r in ok if r["impl"] == impl and (r["config"], r["routing"], r["variant"]) == g), 0)
                for g in groups
            ]
            ax.bar([x + j * width for x in range(len(groups))], vals, width, label=impl)
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(groups))],
            [f"{c}\n{r}" + ("" if v == "plain" else f"\n{v}") for c, r, v in groups],
        )
        ax.set_ylabel("effective TF/s (bf16)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    matmul = run_child("bf16_matmul_8192")
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


def with_rates(row, matmul_tfs, bandwidth_gbs):
    """`row` with its effective TF/s and their fraction of the matmul rate, when it has times; at the decode sizes
    also its forward's floor (`floor_bytes` over the read bandwidth) and the forward's multiple of it."""
    if row.get("status") == "ok":
        shape = CONFIGS[row["config"]]
        fl = flops_forward(*shape)
        row["fwd_tflops"] = fl / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3 * fl / row["fwd_bwd_ms"] / 1e9
        row["fwd_pct_matmul"] = 100 * row["fwd_tflops"] / matmul_tfs
        row["fwd_bwd_pct_matmul"] = 100 * row["fwd_bwd_tflops"] / matmul_tfs
        if is_decode_config(row["config"]):
            row["floor_ms"] = floor_bytes(shape, row["experts_touched"]) / bandwidth_gbs / 1e6
            row["fwd_over_floor"] = row["fwd_ms"] / row["floor_ms"]
    return row


if __name__ == "__main__":
    cli.run(main)
