"""What kind of file a path is, without opening it: a FIFO or a device is refused by name before
any read (reading a FIFO blocks until something writes to it; a device never ends)."""

from __future__ import annotations

import os
import stat

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_kind(path: "str | os.PathLike", *, follow_symlinks: bool = True) -> str:
    """'' for a regular file, a directory or a missing path; else what ``path`` is, e.g.
    ``"a FIFO (named pipe)"`` (and ``"a symbolic link"`` when ``follow_symlinks`` is False)."""
    try:
        mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return ""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return ""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")
