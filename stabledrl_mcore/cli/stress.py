"""``stabledrl stress``: GRPO vs StableDRL with and without ratio noise on the tiny Sudoku setting (the stability experiment)."""

from __future__ import annotations

import argparse

from stabledrl_mcore.experiments.stress import StressOptions, format_stress
from stabledrl_mcore.experiments.stress import run_stress as run
from stabledrl_mcore.experiments.tiny_sudoku import LIKELIHOODS, TinySudoku


def add_stress_arguments(parser: argparse.ArgumentParser) -> None:

    d = StressOptions()
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="base RL config (needs model.checkpoint); default: the embedded tiny Sudoku setting, SFT included",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides for every arm")
    parser.add_argument("--out", default=d.out, help=f"output directory (default {d.out})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded setting (data, SFT, RL)")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"RL steps per arm (default {d.steps})")
    parser.add_argument(
        "--noise",
        default=d.noise,
        choices=("lognormal", "student_t"),
        help="noise on the estimated log-ratio in the noisy arms",
    )
    parser.add_argument("--sigma", type=float, default=d.sigma, help=f"noise scale (default {d.sigma})")
    parser.add_argument(
        "--parallel", type=int, default=d.parallel, help="arms running at once, one CPU thread each (default 2)"
    )
    parser.add_argument(
        "--likelihood",
        default=d.likelihood,
        choices=LIKELIHOODS,
        help=f"likelihood estimator of the embedded setting (default {d.likelihood}; ignored with --config)",
    )


def run_stress(args: argparse.Namespace) -> int:

    opts = StressOptions(
        out=args.out,
        setting=TinySudoku(seed=args.seed),
        config=args.config,
        overrides=tuple(args.overrides),
        steps=args.steps,
        noise=args.noise,
        sigma=args.sigma,
        parallel=args.parallel,
        likelihood=args.likelihood,
    )
    print(format_stress(run(opts, log=lambda m: print(m, flush=True))))
    print(f"\nwritten: {args.out}/stress_summary.json, {args.out}/stress.png")
    return 0
