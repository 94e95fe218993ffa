"""What the RL job draws from its metrics: the reward and accuracy curves, and the sampler/trainer mismatch (the
training job's loss curves are `jax_megamoe.training.plot_loss_curves`)."""

from __future__ import annotations

from jax_megamoe import training


def plot_rl_curves(records: list[dict], path: str) -> None:
    """Plots an RL run against step: the mean reward of each step's samples and the held-out accuracy (where
    evaluated; step 0 is the starting policy)."""
    rewards = [(r["step"], r["reward"]) for r in records if "reward" in r]
    accuracy = [(r["step"], r["accuracy"]) for r in records if "accuracy" in r]
    with training.line_plot(path, xlabel="GRPO step") as ax:
        if rewards:
            ax.plot(*zip(*rewards, strict=True), label="reward (mean of the step's samples)", lw=1)
        if accuracy:
            ax.plot(*zip(*accuracy, strict=True), "o--", label="held-out accuracy (greedy)", ms=3)


MISMATCH_LINES = {
    "log_ratio_p99": "p99 |log pi_trainer - log pi_sampler|",
    "sampler_kl": "KL(sampler || trainer), k3 estimate",
    "routing_mismatch": "share of routing choices that differ",
}


def plot_mismatch(records: list[dict], path: str) -> None:
    """Plots, against step and on a log scale, how far the sampler and the trainer part at each step's first
    update (the policy still the sampler's): the 99th percentile |log ratio|, the k3 KL estimate and the share of
    routing choices that differ (a value of 0 is left out of the log scale)."""
    with training.line_plot(path, xlabel="GRPO step") as ax:
        ax.set_yscale("log")
        for key, label in MISMATCH_LINES.items():
            points = [(r["step"], r[key]) for r in records if r.get(key, 0) > 0]
            if points:  # the routing share is 0 at most steps: points, not a line across the gaps
                style = dict(marker="o", ms=2, ls="none") if key == "routing_mismatch" else dict(lw=1)
                ax.plot(*zip(*points, strict=True), label=label, **style)
