"""A process and everything it started, killed together, also what left its session with ``setsid()``.

Killing a process group misses a child that called ``setsid()`` (or ``setpgid``), and a child whose
parent exited is re-parented to init, out of reach. So a process that hosts user code (the reward
worker of :mod:`~stabledrl_mcore.common.isolated_calls`) calls :func:`become_subreaper` first (Linux
``PR_SET_CHILD_SUBREAPER``): an orphan anywhere below it is re-parented to it instead of init, so
:func:`descendants` (read from ``/proc``) finds every process it started, in any session, until
:func:`kill_tree` kills them. A descendant that exits stays a zombie of the subreaper until the
subreaper itself ends (it holds no memory, only its process-table slot).

A worker that dies without that (``os._exit`` in user code, a signal) cannot vouch for its tree:
its processes that stayed in its session or process group are killed (:func:`kill_session`; the
kernel keeps a pid unused while a session of that id lives), ones that had left it are out of
reach. Where ``/proc`` or ``prctl`` is missing (not Linux) only the process group is killed.
Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable, Dict, List, Tuple

PR_SET_CHILD_SUBREAPER = 36
_ROUNDS = 100
"""Kill rounds at most (a descendant forking while its tree is killed adds one round)."""


def become_subreaper() -> bool:
    """Make this process the subreaper of everything below it (Linux); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _table() -> Dict[int, Tuple[int, int]]:
    """pid -> (parent pid, session id) of every live (not zombie) process in ``/proc``."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 3 and fields[0] not in (b"Z", b"X"):
            table[int(name)] = (int(fields[1]), int(fields[3]))
    return table


def descendants(root: int) -> List[int]:
    """Live processes below ``root`` (children first), read from ``/proc``; [] without it."""
    children: Dict[int, List[int]] = {}
    for pid, (parent, _) in _table().items():
        children.setdefault(parent, []).append(pid)
    found, queue = [], list(children.get(root, []))
    while queue:
        pid = queue.pop(0)
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def session(sid: int) -> List[int]:
    """Live processes of session ``sid`` (a pid stays unused while a session of that id lives)."""
    return [pid for pid, (_, own) in _table().items() if own == sid]


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return not os.path.isdir("/proc")  # /proc shows every pid: not there, not running


def _kill_all(find: Callable[[], List[int]], spare: int) -> None:
    """SIGKILL what ``find()`` returns (but ``spare``) until it returns nothing."""
    for _ in range(_ROUNDS):
        found = [pid for pid in find() if pid != spare]
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def kill_descendants(root: int) -> None:
    """SIGKILL every process below ``root`` until none is left (``root`` itself is spared)."""
    _kill_all(lambda: descendants(root), root)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` and of process group ``sid`` (what a session leader
    that is already gone left in them)."""
    _kill_all(lambda: session(sid), -1)
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` (a live child of the caller, a session leader) with every process below it
    and every process of its session: stopped first, so that it starts nothing more and its orphans
    stay below it while they are killed."""
    try:
        os.kill(root, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        pass
    kill_descendants(root)
    kill_session(root)
    try:
        os.kill(root, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
