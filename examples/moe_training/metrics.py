"""What the RL job draws from its metrics: the reward and accuracy curves (the training job's loss curves are
`jax_megamoe.training.plot_loss_curves`)."""

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
