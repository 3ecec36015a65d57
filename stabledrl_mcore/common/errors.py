"""Errors a person can fix: bad config fields, flags, paths and data files.

The CLI prints these as one line (``stabledrl <cmd>: error: <message>``) and
exits 2; anything else is a bug and keeps its traceback. ``--debug`` or
``STABLEDRL_DEBUG=1`` shows the traceback of user errors too.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from contextlib import contextmanager
from typing import Iterator, Optional


class UserError(Exception):
    """Input that cannot be used as given; the message names it and the fix."""


class RunFailed(RuntimeError):
    """A run that cannot go on for a reason its message names (e.g. every update skipped):
    one line and exit 1, not a traceback (``--debug`` shows it)."""


class DataError(UserError, ValueError):
    """A data file that is empty or holds a malformed row; the message names the file and line."""


# Older error classes of the project whose messages are written for the user, by module. They
# are looked up in ``sys.modules`` only: an error cannot come from a module that was never imported.
_USER_ERROR_CLASSES = (
    ("stabledrl_mcore.config.io", "ConfigError"),
    ("stabledrl_mcore.parallel.bootstrap", "ParallelLayoutError"),
    ("stabledrl_mcore.models.presets", "ModelConfigError"),
    ("stabledrl_mcore.checkpoint.errors", "ConversionError"),
    ("stabledrl_mcore.checkpoint.integrity", "CheckpointError"),
    ("stabledrl_mcore.checkpoint.optimizer_state", "OptimizerFormatError"),
)


def is_user_error(err: BaseException) -> bool:
    """True for errors about the user's input (printed as one line), False for bugs."""
    return _is_user_class(type(err))


def is_user_error_type(qualified_name: Optional[str]) -> bool:
    """:func:`is_user_error` for an exception known by its class's qualified name (a rank's)."""
    module, _, name = (qualified_name or "").rpartition(".")
    if not module:
        return name == "FileNotFoundError"
    try:
        cls = getattr(sys.modules.get(module) or importlib.import_module(module), name, None)
    except ImportError:
        return False
    return isinstance(cls, type) and _is_user_class(cls)


def _is_user_class(cls: type) -> bool:
    if issubclass(cls, (UserError, FileNotFoundError)):
        return True
    for module, name in _USER_ERROR_CLASSES:
        user_cls = getattr(sys.modules.get(module), name, None)
        if user_cls is not None and issubclass(cls, user_cls):
            return True
    return False


def one_line(err: BaseException) -> str:
    """The message of ``err`` on a single line (continuation lines joined with '; ')."""
    text = str(err) or type(err).__name__
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


class ConfigError(UserError, ValueError):
    """The configuration cannot be used as written."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
"""``OSError`` numbers of a write that found no space (or no quota) left."""


class DiskFullError(RunFailed):
    """A write of the run found its file system full (one line: the file, and how to go on)."""


@contextmanager
def disk_full_is_one_line(what: str = "the run") -> Iterator[None]:
    """An ``OSError`` ENOSPC / EDQUOT raised inside the block becomes :class:`DiskFullError` (one line
    naming the file where the error names one), not a traceback; other errors pass unchanged."""
    try:
        yield
    except OSError as err:
        if err.errno not in DISK_FULL:
            raise
        where = f" writing {err.filename}" if err.filename else ""
        raise DiskFullError(
            f"{what} stopped: no space left on the device{where} ({os.strerror(err.errno)}); free space "
            f"there (an unfinished .tmp-step_* is removed by --resume), or move logging.run_dir / checkpoint.dir "
            f"to another file system, then continue with --resume auto"
        ) from None
