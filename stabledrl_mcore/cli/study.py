"""``stabledrl study``: GRPO vs StableDRL under natural ratio noise, several seeds, over a grid of regimes
(the instability study)."""

from __future__ import annotations

import argparse
import os

from stabledrl_mcore.experiments.study import REGIMES, StudyOptions, format_study
from stabledrl_mcore.experiments.study import run_study as run
from stabledrl_mcore.experiments.tiny_sudoku import LIKELIHOODS, TinySudoku


def add_study_arguments(parser: argparse.ArgumentParser) -> None:

    d = StudyOptions()
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides for every arm")
    parser.add_argument(
        "--out", default=d.out, help=f"output directory (default {d.out}); a rerun with the same options resumes it"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded setting (data, SFT, held-out set)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(d.seeds), help="RL seeds per algo (default 0 1 2)")
    parser.add_argument("--algos", nargs="+", default=list(d.algos), help="losses compared (default grpo stabledrl)")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"RL steps per arm (default {d.steps})")
    parser.add_argument(
        "--regime",
        nargs="+",
        default=list(d.regimes),
        choices=tuple(REGIMES),
        help=f"LR / inner iterations / draws; several make several cells (default {' '.join(d.regimes)})",
    )
    parser.add_argument(
        "--lr-scale",
        type=float,
        nargs="+",
        default=[],
        metavar="X",
        help="grid: cells with optim.lr = X times the regime's, one per X",
    )
    parser.add_argument(
        "--inner",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="grid: cells with algo.inner_iterations = N (instead of the regime's), one per N",
    )
    parser.add_argument(
        "--likelihood", default=d.likelihood, choices=LIKELIHOODS, help=f"estimator (default {d.likelihood})"
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=d.prompts_per_step,
        help=f"puzzles per step, x8 completions (default {d.prompts_per_step})",
    )
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out evaluation cadence in steps")
    parser.add_argument("--eval-examples", type=int, default=d.eval_examples, help="held-out puzzles")
    parser.add_argument("--parallel", type=int, default=d.parallel, help="arms at once, one CPU thread each")


def run_study(args: argparse.Namespace) -> int:

    opts = StudyOptions(
        out=args.out,
        setting=TinySudoku(seed=args.seed),
        regimes=tuple(args.regime),
        lr_scales=tuple(args.lr_scale),
        inner=tuple(args.inner),
        overrides=tuple(args.overrides),
        algos=tuple(args.algos),
        seeds=tuple(args.seeds),
        steps=args.steps,
        likelihood=args.likelihood,
        prompts_per_step=args.prompts,
        eval_every=args.eval_every,
        eval_examples=args.eval_examples,
        parallel=args.parallel,
    )
    record = run(opts, log=lambda m: print(m, flush=True))
    print(format_study(record))
    cells = ", ".join(os.path.join(args.out, cell, "study_summary.json") for cell in record["table"])
    print(f"\nwritten: {cells} (and study.png beside each); {args.out}/grid_summary.json, {args.out}/grid.png")
    return 0
