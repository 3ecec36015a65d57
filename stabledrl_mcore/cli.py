"""The ``stabledrl`` command line: parses arguments, chooses configs, calls the library.

Every subcommand is a thin function over library calls. Unknown subcommands
and bad flags print one line and exit with status 2; configuration errors
exit with status 2 as well, naming the offending key.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional, Sequence

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

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        if args.save_config:
            save_config(cfg, args.save_config)
        return 0
    try:
        from .rl.trainer import train  # type: ignore[attr-defined]
    except ImportError:
        return _not_available("train")
    train(cfg, resume=args.resume)
    return 0


def _not_available(name: str) -> int:
    print(f"stabledrl: error: '{name}' is not available in this version yet", file=sys.stderr)
    return EXIT_USAGE


def _build_parser(handlers: Dict[str, Callable]) -> argparse.ArgumentParser:
    parser = _Parser(prog="stabledrl",
                     description="StableDRL post-training of diffusion LMs on Megatron-Core.")
    parser.add_argument("--version", action="version", version=f"stabledrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    train = sub.add_parser("train", help="run StableDRL training (torchrun/srun for many ranks)")
    _add_config_args(train)
    train.add_argument("--resume", default=None, metavar="auto|none|PATH",
                       help="resume from the newest complete checkpoint (auto) or PATH")
    train.add_argument("--print-config", action="store_true",
                       help="validate and print the resolved config, then exit")
    train.add_argument("--save-config", metavar="PATH", help="with --print-config: also write it")
    train.set_defaults(handler=handlers["train"])

    for name, help_text in (("convert", "convert checkpoints between Hugging Face and Megatron"),
                            ("generate", "generate completions from a checkpoint"),
                            ("eval", "evaluate a checkpoint on a task"),
                            ("bench", "measure per-phase throughput and MFU"),
                            ("plan", "estimate per-GPU memory and throughput of a layout")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.set_defaults(handler=handlers.get(name, lambda _a, n=name: _not_available(n)))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``stabledrl`` console script."""
    from .config import ConfigError
    from .parallel.bootstrap import ParallelLayoutError

    parser = _build_parser({"train": _cmd_train})
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        return int(args.handler(args) or 0)
    except (ConfigError, ParallelLayoutError) as err:
        print(f"stabledrl {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
