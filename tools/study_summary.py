"""Summarise a ``stabledrl study`` out directory from what has finished so far, training nothing.

    python tools/study_summary.py runs/main                      # finished arms only
    python tools/study_summary.py runs/main --dest DIR --json    # + the grid record on stdout

``stabledrl study`` writes ``study_summary.json`` / ``grid_summary.json`` only when every arm of
the grid is done; this reads the arms' ``metrics.jsonl`` now, with the study's own definitions
(:func:`~stabledrl_mcore.experiments.study.summarise_study_arm`, :func:`aggregate`,
:func:`format_study`: the same windows and collapse rule, the defaults of ``StudyOptions``).
An arm counts when its last training step reached the ``steps`` of its ``rl_config.yaml``; the
others are listed as partial (``cell/arm step/steps``) and left out of every number. Writes
under ``--dest`` (default ``<out>/summary_so_far``, never the study's own files) each cell's
``study_summary.json`` and ``study.png`` and the grid's ``grid_summary.json`` and ``grid.png``,
with ``finished`` / ``partial`` lists; prints the study's table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, List, Tuple

import yaml

from stabledrl_mcore.experiments.plots import plot_grid, plot_study
from stabledrl_mcore.experiments.runs import read_metrics
from stabledrl_mcore.experiments.study import (
    MANIFEST,
    StudyOptions,
    aggregate,
    format_study,
    grid_title,
    summarise_study_arm,
)

ARM = re.compile(r"^(?P<algo>[a-z0-9_]+)_s(?P<seed>\d+)$")


def arm_progress(run_dir: str) -> Tuple[int, int]:
    """``(last training step in metrics.jsonl, the arm's configured steps)``; 0 when nothing ran."""
    with open(os.path.join(run_dir, "rl_config.yaml")) as handle:
        target = int(yaml.safe_load(handle)["steps"])
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        return 0, target
    steps = [int(r["step"]) for r in read_metrics(run_dir) if "reward_mean" in r]
    return max(steps, default=0), target


def summarise_out(out: str, dest: str, opts: StudyOptions = StudyOptions()) -> Dict:
    """The grid record of ``out``'s finished arms (cells in ``study.json``'s order); writes the
    per-cell and grid files under ``dest``."""
    with open(os.path.join(out, MANIFEST)) as handle:
        manifest = json.load(handle)
    options = manifest["options"]
    tables, finished, partial, seeds, steps = {}, [], [], set(), set()
    for cell in manifest["cells"]:
        cell_dir = os.path.join(out, cell)
        names = sorted(os.listdir(cell_dir)) if os.path.isdir(cell_dir) else []
        runs: List[Dict] = []
        for name in names:
            match = ARM.match(name)
            run_dir = os.path.join(cell_dir, name)
            if not match or not os.path.exists(os.path.join(run_dir, "rl_config.yaml")):
                continue
            done, target = arm_progress(run_dir)
            if done < target:
                partial.append(f"{cell}/{name} {done}/{target}")
                continue
            finished.append(f"{cell}/{name}")
            seeds.add(int(match["seed"]))
            steps.add(target)
            algo, seed = match["algo"], int(match["seed"])
            runs.append(summarise_study_arm(read_metrics(run_dir), algo=algo, seed=seed, opts=opts))
        if not runs:
            continue
        runs.sort(key=lambda r: (r["algo"] != "grpo", r["algo"], r["seed"]))
        os.makedirs(os.path.join(dest, cell), exist_ok=True)
        plot_study(runs, os.path.join(dest, cell, "study.png"))
        record = {"cell": cell, "regime_overrides": manifest["cells"][cell], "table": aggregate(runs), "runs": runs}
        _write(os.path.join(dest, cell, "study_summary.json"), record)
        tables[cell] = record["table"]
    grid = {
        "out": out,
        "overrides": options["overrides"],
        "likelihood": options["likelihood"],
        "steps": sorted(steps)[0] if len(steps) == 1 else sorted(steps),
        "seeds": sorted(seeds),
        "collapse_rule": f"reward_end < reward_start - {opts.collapse_drop:g}",
        "reward_window": opts.window,
        "trend_window": opts.trend_window,
        "early_steps": opts.early_steps,
        "finished": finished,
        "partial": partial,
        "table": tables,
    }
    if tables:
        plot_grid(tables, os.path.join(dest, "grid.png"), title=grid_title(grid) + " (finished arms only)")
    _write(os.path.join(dest, "grid_summary.json"), grid)
    return grid


def _write(path: str, record: Dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="a stabledrl study --out directory (with study.json)")
    parser.add_argument("--dest", help="where to write the summaries (default <out>/summary_so_far)")
    parser.add_argument("--json", action="store_true", help="also print the grid record (tables only)")
    args = parser.parse_args(argv)
    if not os.path.exists(os.path.join(args.out, MANIFEST)):
        parser.error(f"{args.out} has no {MANIFEST}: not a stabledrl study --out directory")
    dest = args.dest or os.path.join(args.out, "summary_so_far")
    grid = summarise_out(args.out, dest)
    print(format_study(grid) if grid["table"] else "\nno arm has finished yet")
    print(f"\nfinished ({len(grid['finished'])}): {', '.join(grid['finished']) or '-'}")
    print(f"partial, left out ({len(grid['partial'])}): {', '.join(grid['partial']) or '-'}")
    print(f"written under {dest}: grid_summary.json, grid.png, <cell>/study_summary.json, <cell>/study.png")
    if args.json:
        print(json.dumps({k: v for k, v in grid.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
