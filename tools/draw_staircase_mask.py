"""Draw SDAR's staircase attention mask, the one the model uses (``AttentionLayout.staircase``).

    python tools/draw_staircase_mask.py --out docs/img/staircase_mask.png     # 3 blocks of 2 tokens

Rows are queries, columns keys, over ``[x_t | x_0]`` (noisy half, clean half); a coloured cell
means the query may attend to the key. The rule (``stabledrl_mcore/models/masks.py``): same
block and same half, or a noisy query seeing earlier clean blocks, or a clean query seeing
clean blocks up to its own.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stabledrl_mcore.models.masks import AttentionLayout  # noqa: E402

ALLOWED, BLOCKED = "#2f6db5", "#ecebe6"


def staircase_allowed(blocks: int, block_size: int):
    """``[2n, 2n]`` bool, True where query row may see key column (``n = blocks * block_size``)."""
    n = blocks * block_size
    return ~AttentionLayout.staircase(block_size).dense(2 * n, 2 * n)[0, 0]


def draw(out_png: str, blocks: int = 3, block_size: int = 2):
    """Write the picture; returns the matrix it plotted (1 = allowed, 0 = blocked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    allowed = staircase_allowed(blocks, block_size).int().numpy()
    size, n = allowed.shape[0], allowed.shape[0] // 2
    fig, ax = plt.subplots(figsize=(4.8, 4.8))
    image = ax.imshow(allowed, cmap=ListedColormap([BLOCKED, ALLOWED]), vmin=0, vmax=1)
    ax.set_xticks([i - 0.5 for i in range(1, size)], minor=True)
    ax.set_yticks([i - 0.5 for i in range(1, size)], minor=True)
    ax.grid(which="minor", color="white", lw=1)
    ax.tick_params(which="minor", length=0)
    for edge in range(block_size, size, block_size):  # block borders, and the halves' border thicker
        width = 2.5 if edge == n else 0.8
        ax.axhline(edge - 0.5, color="black", lw=width)
        ax.axvline(edge - 0.5, color="black", lw=width)
    labels = [f"$x_{'t' if i < n else '0'}$ pos {i % n} b{(i % n) // block_size}" for i in range(size)]
    ax.set_xticks(range(size), labels, rotation=90, fontsize=6)
    ax.set_yticks(range(size), labels, fontsize=6)
    ax.set_xlabel(f"key: [ noisy $x_t$ | clean $x_0$ ], {blocks} blocks (b) of {block_size} tokens", fontsize=8)
    ax.set_ylabel("query: [ noisy $x_t$ | clean $x_0$ ]", fontsize=8)
    ax.set_title("SDAR staircase mask (AttentionLayout.staircase)", fontsize=9)
    ax.legend(
        handles=[Patch(color=ALLOWED, label="may attend"), Patch(color=BLOCKED, label="blocked")],
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.3),
        ncol=2,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(out_png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return image.get_array().data.copy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/staircase_mask.png")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=2)
    args = parser.parse_args(argv)
    draw(args.out, args.blocks, args.block_size)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
