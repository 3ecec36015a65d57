"""The demo (docs/experiments.md): ``python -m stabledrl_mcore.demo --out runs/demo [--seed 0]``.

A complete tiny StableDRL experiment on CPU with nothing downloaded: 4x4
Sudoku data, an own tokenizer, masked-diffusion SFT from scratch on a small
labelled set, StableDRL on unlabelled puzzles scored by the verifier, held-out
evaluations, and one run directory with configs, metrics, checkpoints, an
offline wandb run, ``curves.png`` and ``summary.json``. The library side lives
in :mod:`stabledrl_mcore.experiments`.
"""

from __future__ import annotations

import argparse

from stabledrl_mcore.experiments.demo import DemoOptions, format_summary, run_demo
from stabledrl_mcore.experiments.tiny_sudoku import LIKELIHOODS, POSITION_INPUTS, TinySudoku
from stabledrl_mcore.tasks import get_task


def _blank_range(text: str):
    """``"3,7"`` -> ``(3, 7)``, validated by the sudoku task itself."""
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (e.g. 3,7), got {text!r}") from None
    try:
        get_task("sudoku", blanks=(low, high))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return (low, high)


def main(argv=None) -> int:
    d, s = DemoOptions(), TinySudoku()
    parser = argparse.ArgumentParser(prog="python -m stabledrl_mcore.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=d.out, help=f"run directory (default {d.out})")
    parser.add_argument("--seed", type=int, default=s.seed, help="seed of data, SFT and RL")
    parser.add_argument("--labelled", type=int, default=s.labelled, help="labelled SFT puzzles")
    parser.add_argument(
        "--sft-target", type=float, default=s.sft_target, help="stop SFT once validation accuracy first reaches this"
    )
    parser.add_argument(
        "--sft-blanks",
        type=_blank_range,
        default=None,
        metavar="MIN,MAX",
        help="blank range of the labelled SFT puzzles (default: the task's, 6,10)",
    )
    parser.add_argument(
        "--rl-blanks",
        type=_blank_range,
        default=None,
        metavar="MIN,MAX",
        help="blank range of the unlabelled RL pool and the test set (a curriculum: "
        "--sft-blanks 3,7 --sft-target 0.5 --rl-blanks 8,11)",
    )
    parser.add_argument("--rl-steps", type=int, default=d.rl_steps, help="StableDRL steps")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="RL steps between evaluations")
    parser.add_argument("--test", type=int, default=d.eval_examples, help="held-out test puzzles")
    parser.add_argument("--nproc", type=int, default=d.nproc, help="data-parallel RL ranks (gloo)")
    parser.add_argument("--rollout-steps", type=int, default=d.rollout_steps, help="denoising steps per rollout")
    parser.add_argument("--lr", type=float, default=d.lr, help="RL learning rate (Adam)")
    parser.add_argument(
        "--likelihood",
        default=d.likelihood,
        choices=LIKELIHOODS,
        help=f"sequence likelihood estimator of the RL loss (default {d.likelihood})",
    )
    parser.add_argument(
        "--positions",
        default=s.positions,
        choices=POSITION_INPUTS,
        help="model inputs: learned positions restarting after the prompt's '=' plus a "
        "segment embedding (default), or LLaDA's RoPE over 0..S-1",
    )
    parser.add_argument(
        "--init-std",
        type=float,
        default=d.setting.init_std,
        help=f"std of the normal init of the weight matrices (default {d.setting.init_std}; "
        f"with Megatron's usual {s.init_std} RL gained less here)",
    )
    args = parser.parse_args(argv)
    setting = TinySudoku(
        seed=args.seed,
        labelled=args.labelled,
        sft_target=args.sft_target,
        sft_blanks=args.sft_blanks,
        rl_blanks=args.rl_blanks,
        init_std=args.init_std,
        positions=args.positions,
    )
    opts = DemoOptions(
        out=args.out,
        setting=setting,
        rl_steps=args.rl_steps,
        eval_every=args.eval_every,
        eval_examples=args.test,
        nproc=args.nproc,
        rollout_steps=args.rollout_steps,
        lr=args.lr,
        likelihood=args.likelihood,
    )
    print(format_summary(run_demo(opts, log=lambda m: print(m, flush=True))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
