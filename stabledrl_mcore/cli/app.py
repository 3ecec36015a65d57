"""The ``stabledrl`` command line: parses arguments, chooses configs, calls the library.

Every subcommand is a thin function over library calls. Unknown subcommands
and bad flags print one line and exit with status 2; so do errors in the
user's input (config fields, paths, data files, layouts: :mod:`~stabledrl_mcore.common.errors`),
naming the field, flag or file; ``--debug`` (or ``STABLEDRL_DEBUG=1``) shows
their traceback. ``train`` runs :func:`~.preflight.preflight` before any rank
starts; ``KEY=VALUE`` overrides may stand anywhere on the line.

``train`` and ``sft`` run in two modules: the command module checks (preflight, ``--print-config``)
without loading Megatron-Core or transformers and returns :class:`StartRanks`; only then is
``cli/ranks.py``, which imports the trainers, loaded to start the ranks.
"""

from __future__ import annotations

import argparse
import getpass
import importlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from stabledrl_mcore.cli import command_of, interrupted, wants_traceback
from stabledrl_mcore.common.errors import RunFailed, is_user_error, is_user_error_type, one_line
from stabledrl_mcore.common.files import directory_problem
from stabledrl_mcore.common.version import __version__

EXIT_USAGE = 2
EXIT_FAILURE = 1


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


COMMANDS = (
    # name, help, module under stabledrl_mcore.cli with add_<name>_arguments(parser) and run_<name>(args)
    ("train", "run StableDRL training (torchrun/srun for many ranks)", "train"),
    ("convert", "convert checkpoints between Hugging Face and Megatron", "convert"),
    ("generate", "generate completions from a checkpoint", "generate"),
    ("eval", "evaluate a checkpoint on a task (sharded over ranks)", "eval"),
    ("sft", "masked-diffusion SFT on JSONL/parquet conversations (LLaDA recipe, SDAR staircase)", "sft"),
    ("stress", "GRPO vs StableDRL with and without ratio noise (stability experiment)", "stress"),
    ("study", "GRPO vs StableDRL under natural ratio noise, several seeds (instability study)", "study"),
    ("bench", "measure per-phase throughput and MFU (and a baseline, weak scaling)", "bench"),
    ("plan", "estimate per-GPU memory and throughput of a layout", "plan"),
)
"""The sub-commands. Only the chosen one's module is imported (``importlib``), so ``stabledrl --help``
and a bad flag answer without loading torch and Megatron; the modules are the top layer and may
import anything below (tests/test_layers.py)."""


RANKS_MODULE = "ranks"
"""The module under stabledrl_mcore.cli whose ``start_<name>(args, start)`` runs the ranks of a command
whose ``run_<name>`` returned :class:`StartRanks` (it imports the trainers and so Megatron-Core)."""


@dataclass
class StartRanks:
    """``run_<name>``'s answer when every check before the ranks passed: the config they run."""

    cfg: Any
    overrides: List[str]
    """The overrides the ranks get (the command line's, ``--resume`` / ``--overwrite`` included)."""


def _command_module(module: str):
    return importlib.import_module(f"stabledrl_mcore.cli.{module}")


def _handler(name: str, module: str) -> Callable:
    def handle(args: argparse.Namespace):
        result = getattr(_command_module(module), f"run_{name}")(args)
        if isinstance(result, StartRanks):
            return getattr(_command_module(RANKS_MODULE), f"start_{name}")(args, result)
        return result

    return handle


def _build_parser(handlers: Dict[str, Callable], chosen: Optional[str] = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="stabledrl", description="StableDRL post-training of diffusion LMs on Megatron-Core.")
    parser.add_argument("--version", action="version", version=f"stabledrl {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error (anywhere on the line; or STABLEDRL_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, help_text, module in COMMANDS:
        cmd = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the chosen command's flags
            getattr(_command_module(module), f"add_{name}_arguments")(cmd)
        cmd.set_defaults(handler=handlers.get(name) or _handler(name, module))
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
    return _build_parser({}, chosen)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``main``'s parse of ``argv`` (``--debug`` dropped), running nothing; a bad line exits 2."""
    argv = [token for token in argv if token != "--debug"]
    return _parse(build_parser(next((a for a in argv if not a.startswith("-")), None)), argv)


INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
DYNAMO_COMMANDS = tuple(name for name, _, _ in COMMANDS if name != "plan")
"""The commands that build a model (their modules import ``torch._dynamo``, which creates the cache)."""


def compile_cache_refusal() -> str:
    """Why torch's compile cache (``TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>``)
    cannot be used ('' when it can). torch creates it when ``torch._dynamo`` is first imported (every
    command that builds a model, each rank, eager or compiled), so a bad one was a traceback there;
    ``eval`` / ``generate --compile`` keep their graphs in it (train: ``rollout.compile_cache_dir``)."""
    given = os.environ.get(INDUCTOR_CACHE_VARIABLE)
    if given is None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        path = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
        where = f"torch's compile cache {path} ({INDUCTOR_CACHE_VARIABLE} unset)"
    else:
        path, where = given, f"{INDUCTOR_CACHE_VARIABLE}={given}"
    problem = directory_problem(path)
    if not problem:
        return ""
    return f"{where} {problem}; set {INDUCTOR_CACHE_VARIABLE} to a directory this user can create or write in"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``stabledrl`` console script."""

    argv = list(sys.argv[1:] if argv is None else argv)
    debug, command = wants_traceback(argv), command_of(argv)
    refusal = compile_cache_refusal() if command in DYNAMO_COMMANDS else ""
    if refusal:  # before the command's module (and torch._dynamo, which creates it) is imported
        print(f"stabledrl {command}: error: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    try:  # parsing imports the command's module (torch, Megatron: seconds), where a Ctrl-C is common
        args = parse_args(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        return interrupted(command)
    args.debug = debug
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt as err:  # Ctrl-C: one line (--debug: the traceback, unless --nproc's ranks were stopped)
        if debug and type(err).__name__ != "Interrupted":
            raise
        return interrupted(args.command)
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
