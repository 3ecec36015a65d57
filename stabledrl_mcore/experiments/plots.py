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


GRID_PANELS = (
    # title, (hollow marker's key, filled marker's key), log scale
    ("train reward: start (o) -> end (*)", ("reward_start", "reward_end"), False),
    ("held-out accuracy: start (o) -> end (*)", ("test_accuracy_start", "test_accuracy_end"), False),
    ("grad norm: p99 (o), max (*)", ("p99_grad_norm", "max_grad_norm"), True),
    (
        "log-ratio var (1st iter.): start (o) -> end (*)",
        ("log_ratio_var_first", "log_ratio_var_last"),
        True,
    ),
    ("drift to the initial policy (k1): end (o), max (*)", ("drift_end", "drift_max"), False),
)


def plot_grid(table: Dict[str, Dict[str, Dict]], out_png: str, title: str = "") -> None:
    """One figure of a study grid: per cell (x axis) and algo, the mean over seeds of each panel's
    two summaries (hollow and filled marker) with a min/max bar, and the collapsed count."""
    plt = _pyplot()
    cells = list(table)
    algos = list(dict.fromkeys(a for row in table.values() for a in row))
    fig, axes = plt.subplots(2, 3, figsize=(max(9.0, 0.8 * len(cells) + 5.0), 6.2))
    colors = {"grpo": "tab:red", "stabledrl": "tab:blue"}
    width = 0.8 / max(len(algos), 1)
    for k, algo in enumerate(algos):
        color = colors.get(algo)
        xs = [i + (k - (len(algos) - 1) / 2) * width for i in range(len(cells))]
        for axis, (name, keys, log) in zip(axes.flat, GRID_PANELS):
            for j, (key, face) in enumerate(zip(keys, ("none", color))):
                pts = [
                    (x + (j - 0.5) * width * 0.45, table[c][algo][key]) for x, c in zip(xs, cells) if algo in table[c]
                ]
                if not pts:
                    continue
                x, stats = zip(*pts)
                mean = [s[0] for s in stats]
                err = [[m - s[1] for m, s in zip(mean, stats)], [s[2] - m for m, s in zip(mean, stats)]]
                axis.errorbar(
                    x,
                    mean,
                    yerr=err,
                    fmt="o",
                    ms=4,
                    mfc=face,
                    mec=color,
                    ecolor=color,
                    lw=0.8,
                    label=algo if j else None,
                )
            axis.set_title(name, fontsize=8)
            if log and any(table[c][a][key][0] > 0 for c in cells for a in table[c] for key in keys):
                axis.set_yscale("log")
        axes.flat[5].bar(
            xs,
            [table[c][algo]["collapsed"] if algo in table[c] else 0 for c in cells],
            width=width,
            color=color,
            label=algo,
        )
    axes.flat[5].set_title("collapsed (reward end < start - 0.1), seeds", fontsize=8)
    regimes = {c.split("_lr")[0] for c in cells}
    shared = f"{regimes.pop()}_" if len(regimes) == 1 and all("_lr" in c for c in cells) else ""
    labels = [c[len(shared) :] for c in cells]  # one regime: named in the title, not on every tick
    rotate = len(cells) > 4
    for axis in axes.flat:
        axis.set_xticks(range(len(cells)))
        axis.set_xticklabels(
            labels, rotation=40 if rotate else 0, ha="right" if rotate else "center", rotation_mode="anchor", fontsize=7
        )
        axis.tick_params(axis="y", labelsize=7)
    axes.flat[0].legend(fontsize=7)
    title = ", ".join(t for t in (f"regime {shared[:-1]}" if shared else "", title) if t)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
