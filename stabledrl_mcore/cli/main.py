"""The ``stabledrl`` command line: parses arguments, chooses configs, calls the library.

Every subcommand is a thin function over library calls. Unknown subcommands
and bad flags print one line and exit with status 2; so do errors in the
user's input (config fields, paths, data files, layouts: :mod:`.errors`),
naming the field, flag or file; ``--debug`` (or ``STABLEDRL_DEBUG=1``) shows
their traceback. ``train`` runs :func:`~.preflight.preflight` before any rank
starts; ``KEY=VALUE`` overrides may stand anywhere on the line.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable, Dict, Optional, Sequence

from stabledrl_mcore.common.version import __version__

EXIT_USAGE = 2
EXIT_FAILURE = 1


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML run config (see examples/configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. algo.eps=0.1 parallel.tensor_parallel=2")


def _world_size(nproc: Optional[int], default: Optional[int]) -> Optional[int]:
    """Ranks of the job: ``--nproc``, else the launcher's (torchrun, srun, sbatch), else ``default``."""
    if nproc is not None:
        return nproc
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return default


def run_config_from_args(args: argparse.Namespace, cls=None):
    """``(config, overrides)`` of ``train`` and ``sft``: the file plus overrides, ``--resume`` /
    ``--overwrite`` as ``checkpoint.*`` overrides (the ranks get the same); ``--nproc`` checked; pre-emption handlers installed first (unless
    ``--print-config``), so an early USR1 during the slow start-up is not fatal."""
    from stabledrl_mcore.config.schema import RunConfig, load_config
    from stabledrl_mcore.common.errors import ConfigError

    if not args.print_config:
        from stabledrl_mcore.engine.preemption import install_preemption_handlers

        install_preemption_handlers()
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    overrides = list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    overrides += ["checkpoint.overwrite=true"] if args.overwrite else []
    return load_config(args.config, overrides, cls=cls or RunConfig), overrides


def _cmd_train(args: argparse.Namespace) -> int:
    from stabledrl_mcore.config.schema import save_config
    from stabledrl_mcore.config.io import to_dict
    from stabledrl_mcore.cli.preflight import preflight

    cfg, overrides = run_config_from_args(args)
    # every check that needs no model, before any rank starts; a plain `train` is one process
    report = preflight(cfg, world_size=_world_size(args.nproc, None if args.print_config else 1))
    from stabledrl_mcore.engine.resume import preflight as check_run_directory

    check_run_directory(cfg)  # a used run directory or a resume that cannot fit the config
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        print(f"# {report.summary()}")
        if args.save_config:
            save_config(cfg, args.save_config)
        return 0
    if args.nproc is not None and args.nproc > 1:
        from stabledrl_mcore.parallel.launch import exit_status, spawn

        from stabledrl_mcore.rl.trainer import train_rank
        from stabledrl_mcore.engine.preemption import EXIT_PREEMPTED

        # SIGTERM/SIGUSR1 reach every rank; 75 when they were pre-empted; WorkerFailed names the first failure
        return exit_status(spawn(train_rank, args.nproc, (args.config, tuple(overrides)), timeout=float("inf"),
                                 threads=cfg.parallel.threads, expected_codes=(EXIT_PREEMPTED,), hold_signals=True))
    from stabledrl_mcore.rl.trainer import train_rank

    return train_rank(args.config, overrides)


def _not_available(name: str) -> int:
    print(f"stabledrl: error: '{name}' is not available in this version yet", file=sys.stderr)
    return EXIT_USAGE


def _lazy(module: str, name: str) -> Callable:
    """Import ``module.name`` only when called (so ``stabledrl --help`` stays fast)."""
    def call(*args, **kwargs):
        import importlib

        return getattr(importlib.import_module(module, __package__), name)(*args, **kwargs)

    return call


def _build_parser(handlers: Dict[str, Callable], chosen: Optional[str] = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="stabledrl",
                     description="StableDRL post-training of diffusion LMs on Megatron-Core.")
    parser.add_argument("--version", action="version", version=f"stabledrl {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (anywhere on the line; or STABLEDRL_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    train = sub.add_parser("train", help="run StableDRL training (torchrun/srun for many ranks)")
    _add_config_args(train)
    train.add_argument("--resume", default=None, metavar="auto|none|PATH",
                       help="resume from the newest complete checkpoint (auto) or PATH")
    train.add_argument("--overwrite", action="store_true",
                       help="start afresh in a run directory that holds an earlier run (moved aside, "
                            "never deleted)")
    train.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="start N local ranks (gloo on CPU); clusters use torchrun or srun instead")
    train.add_argument("--print-config", action="store_true",
                       help="validate and print the resolved config, then exit")
    train.add_argument("--save-config", metavar="PATH", help="with --print-config: also write it")
    train.set_defaults(handler=handlers["train"])

    for name, help_text, add_arguments, handler in (
            ("convert", "convert checkpoints between Hugging Face and Megatron",
             _lazy(".checkpoint.convert", "add_convert_arguments"),
             _lazy(".checkpoint.convert", "run_convert")),
            ("generate", "generate completions from a checkpoint",
             _lazy(".commands", "add_generate_arguments"), _lazy(".commands", "run_generate")),
            ("eval", "evaluate a checkpoint on a task (sharded over ranks)",
             _lazy(".commands", "add_eval_arguments"), _lazy(".commands", "run_eval")),
            ("sft", "masked-diffusion SFT on JSONL/parquet conversations (LLaDA recipe, SDAR staircase)",
             _lazy(".sft.command", "add_sft_arguments"), _lazy(".sft.command", "run_sft")),
            ("stress", "GRPO vs StableDRL with and without ratio noise (stability experiment)",
             _lazy(".commands", "add_stress_arguments"), _lazy(".commands", "run_stress")),
            ("bench", "measure per-phase throughput and MFU (and a baseline, weak scaling)",
             _lazy(".bench.run", "add_bench_arguments"), _lazy(".bench.run", "run_bench")),
            ("plan", "estimate per-GPU memory and throughput of a layout",
             _lazy(".plan", "add_plan_arguments"), _lazy(".plan", "run_plan"))):
        cmd = sub.add_parser(name, help=help_text)
        if add_arguments is not None and name == chosen:  # only the chosen command's flags
            add_arguments(cmd)
        cmd.set_defaults(handler=handlers.get(name, handler or (lambda _a, n=name: _not_available(n))))
    return parser


_OVERRIDE = re.compile(r"^[A-Za-z_][\w.\-]*=")


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; ``KEY=VALUE`` overrides may stand anywhere, also after options."""
    args, extra = parser.parse_known_args(argv)
    overrides = [token for token in extra if _OVERRIDE.match(token)]
    unknown = [token for token in extra if not _OVERRIDE.match(token)]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:  # argparse fills a '*' positional once; later overrides come back here, in order
        args.overrides = list(args.overrides) + overrides
    return args


def build_parser(chosen: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser ``main`` uses, with the flags of subcommand ``chosen`` (others: names only)."""
    return _build_parser({"train": _cmd_train}, chosen)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``main``'s parse of ``argv`` (``--debug`` dropped), running nothing; a bad line exits 2."""
    argv = [token for token in argv if token != "--debug"]
    return _parse(build_parser(next((a for a in argv if not a.startswith("-")), None)), argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``stabledrl`` console script."""
    from stabledrl_mcore.common.errors import RunFailed, is_user_error, is_user_error_type, one_line

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("STABLEDRL_DEBUG", "0") not in ("", "0")
    args = parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except Exception as err:  # noqa: BLE001 - bugs keep their traceback, input errors get one line
        failed_rank = getattr(err, "first_error", None)  # parallel.launch.WorkerFailed (--nproc)
        if failed_rank is not None:
            if debug:
                print(err.details, file=sys.stderr)
            print(f"stabledrl {args.command}: error: {failed_rank}", file=sys.stderr)
            return EXIT_USAGE if is_user_error_type(err.first_type) else EXIT_FAILURE
        failed_run = isinstance(err, RunFailed)
        if debug or not (failed_run or is_user_error(err)):
            raise
        if failed_run or _reports_errors():
            print(f"stabledrl {args.command}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_FAILURE if failed_run else EXIT_USAGE


def _reports_errors() -> bool:
    """Under torchrun/srun every rank validates the same input: only global rank 0 prints it
    (once) unless the error came after start-up, where only the failing rank knows it."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    started = "torch.distributed" in sys.modules and sys.modules["torch.distributed"].is_initialized()
    return started or rank in ("", "0")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
