"""PNG plots of experiment runs (matplotlib, Agg backend, no display needed)."""

from __future__ import annotations

from typing import Dict, List, Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_demo_curves(rows: List[Dict[str, float]], out_png: str) -> None:
    """Train reward and held-out accuracy (left), grad norm (right) against RL step."""
    plt = _pyplot()
    train = [r for r in rows if "reward_mean" in r]
    evals = [(r["step"], r["test_accuracy"]) for r in rows if "test_accuracy" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(
        [r["step"] for r in train],
        [r["reward_mean"] for r in train],
        lw=0.8,
        alpha=0.7,
        label="train reward (share of blanks right)",
    )
    if evals:
        axes[0].plot(*zip(*evals), "o-", label="held-out accuracy (step 0 = SFT start)")
    axes[0].set_xlabel("RL step")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    axes[1].plot([r["step"] for r in train], [r.get("grad_norm", float("nan")) for r in train], lw=0.8)
    axes[1].set_xlabel("RL step")
    axes[1].set_ylabel("grad norm (before clipping)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def plot_stress(runs: Sequence[Dict[str, object]], out_png: str, window: int = 5) -> None:
    """Reward (moving average over ``window`` steps) and grad norm (log scale) of every arm."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = {"grpo": "tab:red", "stabledrl": "tab:blue"}
    for run in runs:
        label = f"{run['algo']}, {'noise' if run['noise'] else 'no noise'}"
        style = dict(color=colors.get(str(run["algo"])), linestyle="-" if run["noise"] else "--")
        steps, reward, grad = run["steps"], run["reward_curve"], run["grad_norm_curve"]
        smooth = [
            sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
            for i in range(len(reward))
        ]
        axes[0].plot(steps, smooth, label=label, **style)
        axes[1].semilogy(steps, grad, lw=0.8, label=label, **style)
    axes[0].set_xlabel("RL step")
    axes[0].set_ylabel(f"train reward ({window}-step mean)")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("RL step")
    axes[1].set_ylabel("grad norm (before clipping)")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
