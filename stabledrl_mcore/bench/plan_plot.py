"""``stabledrl plan --plot FILE.png``: per-GPU memory of every layout as stacked bars by component."""

from __future__ import annotations

import os
import textwrap
from typing import Any, Dict, List, Sequence, Tuple

from stabledrl_mcore.common.errors import ConfigError

GIB = 1024**3

# (label, colour) of each stacked component, bottom to top
COMPONENTS = (
    ("weights", "#4c72b0"),
    ("reference weights", "#8172b2"),
    ("gradients", "#dd8452"),
    ("optimizer", "#c44e52"),
    ("activations kept for the backward", "#55a868"),
    ("LM head or one recomputed layer (the larger)", "#8c8c3c"),
    ("rollout beyond the training peak", "#64b5cd"),
    ("overhead", "#b0b0b0"),
)


def memory_components(row: Dict[str, Any]) -> List[Tuple[str, float]]:
    """``(component, bytes)`` of one :func:`~.plan.estimate` row, in :data:`COMPONENTS` order,
    summing to its ``total``: the fixed parts, the training peak (activations kept over the layers,
    then the larger of the LM head's tensors and one recomputed layer: they never coexist), the
    rollout's (or, pipelined, the old-policy log-prob broadcast's) excess over the training peak (the
    phases never coincide) and the overhead."""
    kept = row["activations"] - row["recomputed_layer"]
    peak = max(row["training_peak"], row["rollout_peak"], row.get("likelihood_peak", 0.0))
    return [
        ("weights", row["weights"]),
        ("reference weights", row["reference_weights"]),
        ("gradients", row["gradients"]),
        ("optimizer", row["optimizer"]),
        ("activations kept for the backward", kept),
        ("LM head or one recomputed layer (the larger)", row["training_peak"] - kept),
        ("rollout beyond the training peak", peak - row["training_peak"]),
        ("overhead", row["overhead"]),
    ]


def check_plot_path(path: str) -> None:
    """Refuse a ``--plot`` path that is not a ``.png`` in an existing folder (before any estimate)."""

    if not path.lower().endswith(".png"):
        raise ConfigError(f"--plot {path}: give a .png file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path}: no folder {folder}; create it first")


def plot_plan(
    rows: Sequence[Dict[str, Any]],
    gpu_memory_gib: float,
    out_png: str,
    title: str = "",
    requested: Tuple[int, ...] = (0, 0),
) -> None:
    """One stacked bar per layout (GiB per GPU, worst pipeline stage), the GPU capacity as a line,
    the total with the alternative recompute setting as a marker; ``requested`` = (TP, PP) or
    (TP, PP, EP) marked; a mixture-of-experts model's bars also name their EP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.62 * len(rows) + 2.5), 4.2))
    x = list(range(len(rows)))
    bottoms = [0.0] * len(rows)
    parts = [memory_components(r) for r in rows]
    for index, (name, colour) in enumerate(COMPONENTS):
        heights = [p[index][1] / GIB for p in parts]
        if any(heights):
            ax.bar(x, heights, 0.7, bottom=bottoms, color=colour, label=name)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.axhline(gpu_memory_gib, color="black", lw=1.2, ls="--", label=f"GPU capacity ({gpu_memory_gib:g} GiB)")
    if rows:
        alt = rows[0]["alternative"]["recompute"]
        ax.scatter(
            x,
            [r["alternative"]["total"] / GIB for r in rows],
            marker="_",
            s=300,
            color="black",
            lw=2,
            zorder=3,
            label=f"total with recompute {alt}",
        )
    experts = any(r.get("ep", 1) > 1 for r in rows)
    key = (lambda r: (r["tp"], r["pp"], r.get("ep", 1))) if len(requested) == 3 else (lambda r: (r["tp"], r["pp"]))
    ax.set_xticks(
        x,
        [
            f"TP{r['tp']} PP{r['pp']}\nDP{r['dp']}"
            + (f" EP{r['ep']}" if experts else "")
            + ("" if r["fits"] else "\nno fit")
            + ("\nrequested" if key(r) == tuple(requested) else "")
            for r in rows
        ],
        fontsize=7,
    )
    ax.set_ylabel("GiB per GPU (most loaded stage)")
    ax.set_ylim(0, max([gpu_memory_gib * 1.15] + [b * 1.05 for b in bottoms]))
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    handles, labels = ax.get_legend_handles_labels()  # the stack's order, top first
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
