"""The ``stabledrl`` command: one module per sub-command; the parser, ``main`` and error handling in ``app``."""

from stabledrl_mcore.cli.app import build_parser, main, parse_args

__all__ = ["build_parser", "main", "parse_args"]
