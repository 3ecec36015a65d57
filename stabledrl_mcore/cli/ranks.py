"""The ranks of ``stabledrl train`` and ``stabledrl sft``, started once their command module's checks
passed (:class:`~.app.StartRanks`): one rank here, ``--nproc`` local ranks, or this rank of a
torchrun/srun job. This module imports the trainers (Megatron-Core); ``--print-config`` never loads it.

On success the last line names the newest checkpoint and the commands that resume the run and
evaluate (``train``) or sample from (``sft``) that checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import List, Optional

from stabledrl_mcore.checkpoint.info import MODEL_CONFIG
from stabledrl_mcore.checkpoint.state import find_latest
from stabledrl_mcore.cli import EXIT_INTERRUPTED
from stabledrl_mcore.cli.app import StartRanks
from stabledrl_mcore.engine.preemption import EXIT_PREEMPTED
from stabledrl_mcore.engine.run_dir import checkpoint_root
from stabledrl_mcore.parallel import launch
from stabledrl_mcore.parallel.bootstrap import detect_launch_env
from stabledrl_mcore.parallel.launch import exit_status
from stabledrl_mcore.rl import trainer
from stabledrl_mcore.sft.trainer import sft_rank

_RUN_FLAGS = ("checkpoint.resume=", "checkpoint.overwrite=")
"""Overrides the resume command replaces by ``--resume auto``."""


def start_train(args: argparse.Namespace, start: StartRanks) -> int:
    return _finish("train", args, start, _interruptible("train", trainer.train_rank, args, start))


def start_sft(args: argparse.Namespace, start: StartRanks) -> int:
    return _finish("sft", args, start, _interruptible("sft", sft_rank, args, start))


def _interruptible(command: str, rank_fn, args: argparse.Namespace, start: StartRanks) -> int:
    """:func:`_run`; a Ctrl-C is one line naming the command that resumes the run, and status 130:
    of ``--nproc`` ranks (:class:`~stabledrl_mcore.parallel.launch.Interrupted`: they are stopped) or
    of this process's own rank (``--debug`` keeps its traceback)."""
    try:
        return _run(rank_fn, args, start)
    except KeyboardInterrupt as err:
        if args.debug and not isinstance(err, launch.Interrupted):
            raise
        print(interrupted_line(command, args, start.cfg), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def interrupted_line(command: str, args: argparse.Namespace, cfg) -> str:
    """``stabledrl train: interrupted; resume with: ...`` and the checkpoint it resumes from."""
    path = find_latest(checkpoint_root(cfg))
    where = f"from {path}" if path else "no checkpoint was saved yet, so it starts over"
    return f"stabledrl {command}: interrupted; resume with: {shlex.join(resume_command(command, args))} ({where})"


def resume_command(command: str, args: argparse.Namespace) -> List[str]:
    """The command line that resumes this run from its newest checkpoint (``--resume auto``)."""
    resume = ["stabledrl", command] + (["--config", args.config] if args.config else [])
    resume += [o for o in args.overrides if not o.startswith(_RUN_FLAGS)]
    return resume + (["--nproc", str(args.nproc)] if args.nproc else []) + ["--resume", "auto"]


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


def _finish(command: str, args: argparse.Namespace, start: StartRanks, status: int) -> int:
    if status == 0 and detect_launch_env().rank == 0:  # once per job: this process, or rank 0 of torchrun/srun
        print(checkpoint_line(command, args, start.cfg), flush=True)
    return status


def checkpoint_line(command: str, args: argparse.Namespace, cfg) -> str:
    """``checkpoint: PATH  resume: ...  eval: ...`` (``generate:`` after ``sft``): the newest complete
    checkpoint of the run and commands that work on it as printed."""

    root = checkpoint_root(cfg)
    path = find_latest(root)
    if path is None:
        return f"checkpoint: none under {root} (checkpoint.save_every / checkpoint.dir)"
    resume = resume_command(command, args)
    if command == "sft":
        use = "generate: " + shlex.join(["stabledrl", "generate", "--ckpt", path, "--prompt", "YOUR PROMPT"])
    else:
        use = "eval: " + shlex.join(eval_command(cfg, path))
    return f"checkpoint: {path}  resume: {shlex.join(resume)}  {use}"


def eval_command(cfg, path: str) -> List[str]:
    """``stabledrl eval`` of checkpoint ``path`` on the run's task and held-out split, decoding and
    prompting as the rollouts did (greedy, eval's default)."""

    r = cfg.rollout
    arch = _arch(path)
    cmd = ["stabledrl", "eval", "--ckpt", path, "--task", r.task, "--split", cfg.eval.split]
    cmd += ["--limit", str(cfg.eval.num_examples)]
    cmd += ["--data-path", cfg.eval.data_path] if cfg.eval.data_path else []
    cmd += ["--gen-length", str(r.gen_length), "--steps", str(r.steps)]
    if arch != "sdar":  # SDAR decodes with its own block size
        cmd += ["--block-length", str(r.block_length)]
        cmd += ["--cache", r.cache] if r.cache != "none" else []
    cmd += ["--threshold", str(r.threshold)] if r.threshold is not None else []
    cmd += ["--compile", r.compile] if r.compile != "none" else []
    cmd += ["--prompt-style", r.prompt_style]
    if r.prompt_style == "chat":  # compact prompts are the bare question (eval refuses the flags)
        cmd += ["--system-prompt", r.system_prompt] if r.system_prompt is not None else []
        cmd += ["--prompt-template", r.prompt_template] if r.prompt_template != "{question}" else []
        cmd += ["--chat-template", r.chat_template] if r.chat_template else []
    return cmd


def _arch(path: str) -> Optional[str]:
    try:
        with open(os.path.join(path, MODEL_CONFIG)) as handle:
            return json.load(handle).get("arch")
    except (OSError, ValueError):
        return None
