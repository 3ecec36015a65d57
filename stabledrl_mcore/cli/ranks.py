"""The ranks of ``stabledrl train`` and ``stabledrl sft``, started once their command module's checks
passed (:class:`~.app.StartRanks`): one rank here, ``--nproc`` local ranks, or this rank of a
torchrun/srun job. This module imports the trainers (Megatron-Core); ``--print-config`` never loads it.
"""

from __future__ import annotations

import argparse

from stabledrl_mcore.cli.app import StartRanks
from stabledrl_mcore.engine.preemption import EXIT_PREEMPTED
from stabledrl_mcore.parallel import launch
from stabledrl_mcore.parallel.launch import exit_status
from stabledrl_mcore.rl import trainer
from stabledrl_mcore.sft.trainer import sft_rank


def start_train(args: argparse.Namespace, start: StartRanks) -> int:
    return _run(trainer.train_rank, args, start)


def start_sft(args: argparse.Namespace, start: StartRanks) -> int:
    return _run(sft_rank, args, start)


def _run(rank_fn, args: argparse.Namespace, start: StartRanks) -> int:
    if args.nproc is not None and args.nproc > 1:
        # SIGTERM/SIGUSR1 reach every rank; 75 when they were pre-empted; WorkerFailed names the first failure
        return exit_status(
            launch.spawn(
                rank_fn,
                args.nproc,
                (args.config, tuple(start.overrides)),
                timeout=float("inf"),
                threads=start.cfg.parallel.threads,
                expected_codes=(EXIT_PREEMPTED,),
                hold_signals=True,
            )
        )
    return rank_fn(args.config, start.overrides)
