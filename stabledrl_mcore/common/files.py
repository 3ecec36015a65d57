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


def directory_problem(path: "str | os.PathLike") -> str:
    """'' when ``path`` is a directory this process can write in, or one it can create (its nearest
    existing ancestor is a writable directory); else why not, e.g. ``"is a file, not a directory"``
    or ``"cannot be created: /x is not writable"``. Reads only (``os.access``: the effective user,
    read-only file systems included); creates nothing."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"is {special_kind(path) or 'a file'}, not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is a directory this user cannot write in"
        return ""
    if os.path.islink(path):
        return "is a broken symbolic link"
    ancestor = os.path.dirname(path)
    while not os.path.exists(ancestor) and os.path.dirname(ancestor) != ancestor:
        if os.path.islink(ancestor):
            return f"cannot be created: {ancestor} is a broken symbolic link"
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"cannot be created: {ancestor} is {special_kind(ancestor) or 'a file'}, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be created: {ancestor} is a directory this user cannot write in"
    return ""
