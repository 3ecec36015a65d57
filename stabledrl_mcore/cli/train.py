"""``stabledrl train``: preflight, then one rank, ``--nproc`` local ranks, or this rank of a torchrun/srun job."""

from __future__ import annotations

import argparse

import yaml

from stabledrl_mcore.cli.args import add_config_args, add_run_arguments, run_config_from_args, world_size
from stabledrl_mcore.cli.preflight import preflight
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import save_config
from stabledrl_mcore.engine.preemption import EXIT_PREEMPTED
from stabledrl_mcore.engine.resume import check_resume
from stabledrl_mcore.parallel import launch
from stabledrl_mcore.parallel.launch import exit_status
from stabledrl_mcore.rl import trainer


def run_train(args: argparse.Namespace) -> int:

    cfg, overrides = run_config_from_args(args)
    # every check that needs no model, before any rank starts; a plain `train` is one process
    report = preflight(cfg, world_size=world_size(args.nproc, None if args.print_config else 1))

    check_resume(cfg)  # a used run directory or a resume that cannot fit the config
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        print(f"# {report.summary()}")
        if args.save_config:
            save_config(cfg, args.save_config)
        return 0
    if args.nproc is not None and args.nproc > 1:
        # SIGTERM/SIGUSR1 reach every rank; 75 when they were pre-empted; WorkerFailed names the first failure
        return exit_status(
            launch.spawn(
                trainer.train_rank,
                args.nproc,
                (args.config, tuple(overrides)),
                timeout=float("inf"),
                threads=cfg.parallel.threads,
                expected_codes=(EXIT_PREEMPTED,),
                hold_signals=True,
            )
        )

    return trainer.train_rank(args.config, overrides)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    add_run_arguments(parser)
    parser.add_argument("--save-config", metavar="PATH", help="with --print-config: also write it")
