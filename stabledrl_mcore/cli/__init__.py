"""The ``stabledrl`` command: one module per sub-command; the parser, ``main`` and error handling in ``app``.

``main`` here is the console script's entry: it imports ``app`` itself, so a Ctrl-C during that
import (the first tenth of a second of every command) is the same one line and status 130 as a
later one, not a traceback; output piped into a reader that stops early (``| head``) ends the
command quietly (status 141, as a shell reports SIGPIPE). ``build_parser`` and ``parse_args`` are ``app``'s, loaded on first use.
"""

import importlib
import os
import sys
from typing import Optional

__all__ = ["build_parser", "main", "parse_args"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C (of this process, or of a --nproc launcher: parallel.launch.Interrupted)
_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader closed the pipe


def wants_traceback(argv) -> bool:
    """``--debug`` anywhere on the line, or ``STABLEDRL_DEBUG`` set to anything but 0."""
    return "--debug" in argv or os.environ.get("STABLEDRL_DEBUG", "0") not in ("", "0")


def command_of(argv) -> Optional[str]:
    """The sub-command a line names (its first word that is not a flag), None for a bare one."""
    return next((a for a in argv if not a.startswith("-")), None)


def interrupted(command: Optional[str]) -> int:
    """A Ctrl-C's one line on stderr, and its status."""
    print(f"stabledrl {command}: interrupted" if command else "stabledrl: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv=None) -> int:
    """``stabledrl ARGV``: :func:`stabledrl_mcore.cli.app.main`, a Ctrl-C while importing it included."""
    try:
        run = importlib.import_module("stabledrl_mcore.cli.app").main
    except KeyboardInterrupt:
        args = list(sys.argv[1:] if argv is None else argv)
        if wants_traceback(args):
            raise
        return interrupted(command_of(args))
    try:
        status = run(argv)
        sys.stdout.flush()  # here, not at the interpreter's exit, where a closed pipe is a traceback
        return status
    except BrokenPipeError:  # `stabledrl plan ... | head`: the reader left; no traceback, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's own flush at exit fails no more
        return _BROKEN_PIPE


def __getattr__(name: str):
    if name in ("build_parser", "parse_args"):
        return getattr(importlib.import_module("stabledrl_mcore.cli.app"), name)
    raise AttributeError(f"module 'stabledrl_mcore.cli' has no attribute {name!r}")
