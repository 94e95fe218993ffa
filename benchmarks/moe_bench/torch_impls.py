"""The torch peers (torchtitan's MoE experts on `torch._grouped_mm`, and on torchao's FP8 rowwise recipe), their
variants, and one torch row: inputs drawn, peak memory of one forward+backward, the FP8 peer's distance to the bf16
one, times."""

from __future__ import annotations

import math

from .shapes import CONFIGS, VARIANTS, log_prior
from .timing import time_calls


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
