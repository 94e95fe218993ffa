"""Throughput accounting (FLOPs per token, MFU), the metrics JSONL, and the plots of a training run (loss) and of an
RL run (reward and accuracy)."""

from __future__ import annotations

import json
import os

# Dense bf16 matmul FLOP/s used as the MFU denominator, by device kind: measured bf16 matmul rates
# (benchmarks/README.md's 8192^3 product), not the datasheets'. Other devices: pass --peak-tflops.
PEAK_FLOPS = {"H200": 785e12, "H100": 771e12}


def active_params_per_token(config) -> int:
    """Matmul parameters one token passes through: attention projections, the router and its top-k
    experts (or the dense MLP) per layer, and the LM head. Embedding lookups and norms are not matmuls."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    total = config.vocab_size * hidden
    for layer in range(config.num_hidden_layers):
        if config.is_moe_layer(layer):
            mlp = hidden * config.num_experts + config.num_experts_per_tok * 3 * hidden * config.moe_intermediate_size
        else:
            mlp = 3 * hidden * config.intermediate_size
        total += attention + mlp
    return total


def train_flops_per_token(config, seq: int) -> float:
    """Training FLOPs per token: `6 * N_active + 6 * L * S * n_heads * head_dim`.

    6 = 2 (multiply-add) x 3 (forward + two backward matmuls) per active parameter. The attention term
    is QK^T and PV (4 * S * n_heads * head_dim forward, per layer) halved by the causal mask, times 3.
    """
    attention = 6 * config.num_hidden_layers * seq * config.num_attention_heads * config.head_dim
    return 6 * active_params_per_token(config) + attention


def peak_flops(device_kind: str, override_tflops: float | None) -> float | None:
    """The MFU denominator for `device_kind` in FLOP/s (whole mesh: multiply by the device count), or None."""
    if override_tflops:
        return override_tflops * 1e12
    return next((flops for kind, flops in PEAK_FLOPS.items() if kind in device_kind), None)


class MetricsLog:
    """Appends one JSON object per line to `metrics.jsonl` (append mode: a resumed run continues it)."""

    def __init__(self, out_dir: str, fresh: bool):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._file = open(self.path, "w" if fresh else "a")  # noqa: SIM115 - open for the run, closed by close()

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curves(curves: dict[str, list[dict]], path: str) -> None:
    """Plots the train LM loss (and eval loss where logged) against step, one line pair per named run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, records in curves.items():
        train = [(r["step"], r["lm_loss"]) for r in records if "lm_loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
        if train:
            (line,) = ax.plot(*zip(*train, strict=True), label=f"{name} train", lw=1)
            if evals:
                ax.plot(*zip(*evals, strict=True), "o--", color=line.get_color(), label=f"{name} eval", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rl_curves(records: list[dict], path: str) -> None:
    """Plots an RL run against step: the mean reward of each step's samples and the held-out accuracy (where
    evaluated; step 0 is the starting policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rewards = [(r["step"], r["reward"]) for r in records if "reward" in r]
    accuracy = [(r["step"], r["accuracy"]) for r in records if "accuracy" in r]
    if rewards:
        ax.plot(*zip(*rewards, strict=True), label="reward (mean of the step's samples)", lw=1)
    if accuracy:
        ax.plot(*zip(*accuracy, strict=True), "o--", label="held-out accuracy (greedy)", ms=3)
    ax.set_xlabel("GRPO step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
