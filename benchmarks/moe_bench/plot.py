"""The chart of a run's rows: each implementation's effective TF/s per config, routing and variant, forward and
forward+backward."""

from __future__ import annotations

from .shapes import CONFIGS, VARIANTS


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
