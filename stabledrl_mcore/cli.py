"""The ``stabledrl`` command line: parses arguments, chooses configs, calls the library.

Every subcommand is a thin function over library calls. Unknown subcommands
and bad flags print one line and exit with status 2; configuration errors
exit with status 2 as well, naming the offending key.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, Optional, Sequence

from . import __version__

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML run config (see examples/configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted overrides, e.g. algo.eps=0.1 parallel.tensor_parallel=2")


def _cmd_train(args: argparse.Namespace) -> int:
    from .config import load_config, save_config, to_dict

    if not args.print_config:
        from .rl.trainer import install_preemption_handlers

        install_preemption_handlers()  # before the slow start-up, so an early USR1 is not fatal
    overrides = list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    overrides += ["checkpoint.overwrite=true"] if args.overwrite else []
    cfg = load_config(args.config, overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        if args.save_config:
            save_config(cfg, args.save_config)
        return 0
    from .checkpoint.resume import preflight

    preflight(cfg)  # a used run directory or a resume that cannot fit: refused before any rank starts
    if args.nproc > 1:
        from .parallel.launch import spawn

        from .rl.trainer import train_rank

        spawn(train_rank, args.nproc, (args.config, tuple(overrides)),
              timeout=float("inf"), threads=cfg.parallel.threads)
        return 0
    from .rl.trainer import train_rank

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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    train = sub.add_parser("train", help="run StableDRL training (torchrun/srun for many ranks)")
    _add_config_args(train)
    train.add_argument("--resume", default=None, metavar="auto|none|PATH",
                       help="resume from the newest complete checkpoint (auto) or PATH")
    train.add_argument("--overwrite", action="store_true",
                       help="start afresh in a run directory that holds an earlier run (moved aside, "
                            "never deleted)")
    train.add_argument("--nproc", type=int, default=1, metavar="N",
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``stabledrl`` console script."""
    from .checkpoint.integrity import CheckpointError
    from .config import ConfigError
    from .parallel.bootstrap import ParallelLayoutError

    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = _build_parser({"train": _cmd_train}, chosen)
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ConfigError, ParallelLayoutError, CheckpointError) as err:
        print(f"stabledrl {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
