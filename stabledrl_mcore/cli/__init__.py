"""The ``stabledrl`` command: one module per sub-command; the parser and error handling in ``main``."""

from stabledrl_mcore.cli.main import build_parser, main, parse_args

__all__ = ["build_parser", "main", "parse_args"]
