"""``stabledrl train``: preflight (and ``--print-config``) here, without Megatron-Core or transformers;
then one rank, ``--nproc`` local ranks, or this rank of a torchrun/srun job (:mod:`.ranks`)."""

from __future__ import annotations

import argparse

import yaml

from stabledrl_mcore.cli.app import StartRanks
from stabledrl_mcore.cli.args import add_config_args, add_run_arguments, run_config_from_args, world_size
from stabledrl_mcore.cli.preflight import preflight
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import save_config
from stabledrl_mcore.engine.resume import check_resume


def run_train(args: argparse.Namespace):
    """The checks before any rank starts; ``--print-config`` ends here (exit status 0), else
    :class:`StartRanks` for :func:`~.ranks.start_train`."""

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
    return StartRanks(cfg, overrides)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    add_run_arguments(parser)
    parser.add_argument("--save-config", metavar="PATH", help="with --print-config: also write it")
