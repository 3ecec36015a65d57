"""docs/img/staircase_mask.png: tools/draw_staircase_mask.py plots the model's real staircase mask."""

import importlib.util
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "draw_staircase_mask", os.path.join(ROOT, "tools", "draw_staircase_mask.py")
)
drawer = sys.modules.setdefault("draw_staircase_mask", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(drawer)

# 3 blocks of 2 tokens over [x_t | x_0], by hand from the rule in models/masks.py: same block and
# same half; a noisy query sees the clean blocks before its own; a clean query the clean blocks up
# to its own. Rows = queries, columns = keys, 1 = may attend.
EXPECTED = """
    11 00 00 | 00 00 00
    11 00 00 | 00 00 00
    00 11 00 | 11 00 00
    00 11 00 | 11 00 00
    00 00 11 | 11 11 00
    00 00 11 | 11 11 00
    00 00 00 | 11 00 00
    00 00 00 | 11 00 00
    00 00 00 | 11 11 00
    00 00 00 | 11 11 00
    00 00 00 | 11 11 11
    00 00 00 | 11 11 11
"""


def expected_cells():
    return np.array([[int(c) for c in row if c in "01"] for row in EXPECTED.split("\n") if row.strip()])


def test_the_plotted_cells_are_the_staircase_rule(tmp_path):
    out = tmp_path / "mask.png"
    plotted = drawer.draw(str(out), blocks=3, block_size=2)
    assert plotted.shape == (12, 12) and np.array_equal(plotted, expected_cells())
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_picture_is_small_and_present():
    path = os.path.join(ROOT, "docs", "img", "staircase_mask.png")
    assert 5_000 < os.path.getsize(path) < 60_000
