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


STUDY_PANELS = (
    ("reward_curve", "train reward"),
    ("eval_curve", "held-out accuracy"),
    ("log_ratio_var_curve", "log-ratio variance (1st iteration)"),
    ("clip_frac_high_curve", "clip fraction, high (dashed: low)"),
    ("grad_norm_curve", "grad norm (before clipping)"),
    ("drift_curve", "drift to the initial policy (k1)"),
)


def _band(axis, steps, curves, color, label, window, log=False, linestyle="-"):
    """Mean over seeds of the ``window``-step moving averages, and their min/max band."""
    n = min(len(c) for c in curves)
    smooth = [
        [sum(c[max(0, i - window + 1) : i + 1]) / len(c[max(0, i - window + 1) : i + 1]) for i in range(n)]
        for c in curves
    ]
    mean = [sum(col) / len(col) for col in zip(*smooth)]
    axis.plot(steps[:n], mean, color=color, label=label, lw=1.0, linestyle=linestyle)
    axis.fill_between(
        steps[:n], [min(col) for col in zip(*smooth)], [max(col) for col in zip(*smooth)], color=color, alpha=0.2, lw=0
    )
    if log and max(mean, default=0.0) > 0:
        axis.set_yscale("log")


def plot_study(runs: Sequence[Dict[str, object]], out_png: str, window: int = 5) -> None:
    """Six panels against RL step, per algo the mean over seeds with a min/max band (moving
    averages over ``window`` steps; held-out accuracy as evaluated)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    colors = {"grpo": "tab:red", "stabledrl": "tab:blue"}
    for algo in dict.fromkeys(str(r["algo"]) for r in runs):
        mine = [r for r in runs if r["algo"] == algo]
        color, label = colors.get(algo), f"{algo} ({len(mine)} seeds)"
        steps = list(mine[0]["steps"])
        for axis, (key, title) in zip(axes.flat, STUDY_PANELS):
            axis.set_title(title, fontsize=9)
            if key == "eval_curve":
                evals = [r[key] for r in mine if r[key]]
                if evals:
                    _band(axis, [s for s, _ in evals[0]], [[a for _, a in e] for e in evals], color, label, 1)
                continue
            _band(axis, steps, [r[key] for r in mine], color, label, window, log=key == "grad_norm_curve")
            if key == "clip_frac_high_curve":
                _band(axis, steps, [r["clip_frac_low_curve"] for r in mine], color, None, window, linestyle="--")
    for axis in axes.flat:
        axis.set_xlabel("RL step", fontsize=8)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
