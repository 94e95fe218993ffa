"""The table of a run's rows, printed at its end."""

from __future__ import annotations

from .shapes import is_decode_config


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
