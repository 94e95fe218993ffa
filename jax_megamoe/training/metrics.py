"""A run's metrics as JSON lines (one record per step), and its loss curves."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any


class MetricsLog:
    """Appends one JSON object per line to `OUT_DIR/metrics.jsonl` (`fresh`: truncated first; else appended to, as
    a resumed run continues its log)."""

    def __init__(self, out_dir: str, fresh: bool):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._file = open(self.path, "w" if fresh else "a")  # noqa: SIM115 - open for the run, closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@contextlib.contextmanager
def line_plot(path: str, *, xlabel: str, ylabel: str | None = None) -> Iterator[Any]:
    """The axes of a matplotlib figure to draw lines on (`with line_plot(path, xlabel="step") as ax: ax.plot(...)`),
    saved to the image file `path` with a grid and a legend when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        ax.set_xlabel(xlabel)
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_loss_curves(curves: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Plots the training LM loss (`lm_loss`) and, where logged, the eval loss (`eval_loss`) against `step`, one
    pair of lines per named run, into the image file `path`."""
    with line_plot(path, xlabel="step", ylabel="loss (nats / token)") as ax:
        for name, records in curves.items():
            train = [(r["step"], r["lm_loss"]) for r in records if "lm_loss" in r]
            evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
            if train:
                (line,) = ax.plot(*zip(*train, strict=True), label=f"{name} train", lw=1)
                if evals:
                    ax.plot(*zip(*evals, strict=True), "o--", color=line.get_color(), label=f"{name} eval", ms=3)
