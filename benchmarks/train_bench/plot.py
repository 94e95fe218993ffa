"""The chart of a run's result: each stack's step time with its breakdown, and its peak memory."""

from __future__ import annotations


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return
    ok = [r for r in result["stacks"] if r.get("status") == "ok"]
    if not ok:
        return
    fig, (ax_t, ax_m) = plt.subplots(
        1, 2, figsize=(15, 0.6 * len(ok) + 2.6), sharey=True, gridspec_kw=dict(width_ratios=(3, 1))
    )
    ys = range(len(ok))
    parts = (
        ("experts_ms", "experts", "tab:red"),
        ("optimizer_ms", "optimizer", "tab:orange"),
        ("lm_head_loss_ms", "LM head + loss", "tab:purple"),
        ("rest_ms", "rest", "tab:gray"),
    )
    labelled = set()
    for y, r in zip(ys, ok, strict=True):
        # The whole step, then the breakdown's parts over it (each a difference of medians: one that noise
        # makes negative is drawn as nothing, and the parts then fall short of the step).
        ax_t.barh(y, r["median_step_ms"], color="tab:blue", alpha=0.35 if "breakdown" in r else 1.0)
        left = 0.0
        for key, name, color in parts if "breakdown" in r else ():
            value = max(r["breakdown"][key], 0.0)
            ax_t.barh(y, value, left=left, height=0.5, color=color, label=None if name in labelled else name)
            labelled.add(name)
            left += value
        note = f" {r['median_step_ms']:.1f} ms, {r['tokens_per_s'] / 1e3:,.1f}k tok/s"
        if r.get("mfu") is not None:
            note += f", MFU {100 * r['mfu']:.0f}%"
        ax_t.text(max(r["median_step_ms"], left), y, note, va="center", fontsize=8)
        ax_m.barh(y, r.get("peak_memory_gib") or 0.0, color="tab:green")
    ax_t.set_yticks(list(ys), [r["label"] for r in ok])
    ax_t.invert_yaxis()
    ax_t.set_xlabel("median step time (ms)")
    ax_t.set_xlim(0, 1.6 * max(r["median_step_ms"] for r in ok))
    ax_t.set_title(
        f"training step, {result['preset']} ({result['config']['num_hidden_layers']} layers), batch "
        f"{result['batch']} x seq {result['seq']}, {result['matmul'].get('device', '')}"
    )
    if labelled:
        ax_t.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(parts), fontsize=8, frameon=False)
    ax_m.set_xlabel("peak device memory (GiB)")
    if all(r.get("peak_memory_gib") is None for r in ok):
        ax_m.text(
            0.5, 0.5, "no memory statistics\non this platform", ha="center", va="center", transform=ax_m.transAxes
        )
        ax_m.set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
