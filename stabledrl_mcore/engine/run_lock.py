"""One run per run directory: rank 0 holds an exclusive ``flock`` on ``<run_dir>/.lock``.

Two trainings into one ``logging.run_dir`` (a SLURM requeue while the old instance still runs,
two ``sbatch`` of one script) would prune each other's checkpoints, delete each other's
``.tmp-step_*`` and move each other's metrics aside. So:

* rank 0 of a run (RL and SFT) takes an exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` (the
  directory is created if needed) before anything in the run directory is moved, pruned or
  deleted (``--overwrite`` included), holds it for the whole run and writes its host, pid,
  SLURM job id / step / restart count and start time into the file;
* a second run into the directory is refused with one line naming the holder
  (:class:`RunDirLockedError`): first by the CLI's preflight before any rank starts
  (:func:`wait_until_unlocked`, a shared lock taken and dropped at once), then again by
  rank 0 at start (the race of two starts);
* a holder killed by SIGKILL leaves no stale lock: the kernel drops a ``flock`` with the last
  descriptor of its process (the file stays, with the dead holder's record, but locks
  nothing);
* a SLURM requeue whose earlier instance (the same ``SLURM_JOB_ID``) still holds the lock
  waits up to ``logging.lock_wait_s`` seconds (default 300; 0 = refuse at once) for it to
  end, then refuses naming it; any other holder is refused at once;
* a file system without locks (NFS without a lock manager: ``ENOLCK``; Lustre without
  ``-o flock``: ``ENOSYS``; ``EOPNOTSUPP``) is one line (:class:`RunLockUnsupportedError`)
  naming the fixes: mount it with locks, or ``logging.run_lock=false`` to run unlocked.

The lock is per process and re-entrant (``train_rank`` holds it around ``train``, which takes it
again); a child forked meanwhile closes its copy of the descriptor (the parent keeps the lock).
The holding process never opens the lock file a second time: on NFS Linux implements ``flock``
with POSIX locks, which any ``close`` of the file in the process would drop.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch

from stabledrl_mcore.common.errors import UserError
from stabledrl_mcore.parallel.bootstrap import detect_launch_env

LOCK_FILE = ".lock"
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
"""``flock`` errors of a file system that has no locks (NFS without lockd, Lustre without flock)."""
POLL_S = 0.25
NAME_GRACE_S = 2.0
"""How long a locked file without a holder record is retried: the holder is writing it."""

_HELD: Dict[str, List[int]] = {}  # lock file (real path) -> [descriptor, depth]


class RunDirLockedError(UserError):
    """Another run holds the run directory's lock (one line: the holder, and how to proceed)."""


class RunLockUnsupportedError(UserError):
    """The run directory's file system does not support ``flock`` (one line: the fixes)."""


def lock_path(run_dir: str) -> str:
    return os.path.join(run_dir, LOCK_FILE)


def holder_record() -> Dict[str, Any]:
    """What this process writes into the lock file it holds."""
    env = os.environ
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": env.get("SLURM_JOB_ID") or None,
        "slurm_step_id": env.get("SLURM_STEP_ID") or None,
        "slurm_restart_count": env.get("SLURM_RESTART_COUNT") or None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv)[:500],
    }


def read_holder(path: str) -> Dict[str, Any]:
    """The record in lock file ``path`` ({} when missing, empty or unreadable)."""
    try:
        with open(path) as handle:
            data = json.loads(handle.read() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe_holder(holder: Dict[str, Any]) -> str:
    """``host h, pid 12, SLURM job 34 step 0 (restart 1), since 2025-01-01T00:00:00Z``."""
    if not holder:
        return "a process that has not written its name yet"
    parts = [f"host {holder.get('host', '?')}", f"pid {holder.get('pid', '?')}"]
    if holder.get("slurm_job_id"):
        job = f"SLURM job {holder['slurm_job_id']}"
        if holder.get("slurm_step_id") is not None:
            job += f" step {holder['slurm_step_id']}"
        if holder.get("slurm_restart_count") is not None:
            job += f" (restart {holder['slurm_restart_count']})"
        parts.append(job)
    if holder.get("started"):
        parts.append(f"since {holder['started']}")
    return ", ".join(parts)


def _same_job(holder: Dict[str, Any]) -> bool:
    """The holder is an earlier instance of this SLURM job (a requeue started before it ended)."""
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and str(holder.get("slurm_job_id")) == job


def _gone(holder: Dict[str, Any]) -> bool:
    """The holder's pid no longer exists on this host (a process it started keeps the file open)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _refusal(run_dir: str, path: str, holder: Dict[str, Any], waited: Optional[float]) -> str:
    who = describe_holder(holder)
    if _gone(holder):
        who += f"; that pid is gone, but a process it started still has {path} open (fuser {path} names it)"
    if waited is not None:
        how = (
            f"waited {waited:.0f} s (logging.lock_wait_s) for this job's earlier instance to end; wait "
            f"longer (raise logging.lock_wait_s), or give this run another logging.run_dir"
        )
    else:
        how = "wait for that run to end, or give this run another logging.run_dir"
    return f"run directory {run_dir} is in use by another run ({who}; it holds {path}); {how}"


def _unsupported(run_dir: str, path: str, err: OSError) -> RunLockUnsupportedError:
    return RunLockUnsupportedError(
        f"cannot lock {path}: the file system of logging.run_dir={run_dir} does not support file locks "
        f"({err.strerror or err}); mount it with locks (NFS: a running lock manager, not 'nolock'; "
        f"Lustre: -o flock), choose a logging.run_dir on a file system with locks, or set "
        f"logging.run_lock=false to run without the lock (nothing then refuses a second run into it)"
    )


def _flock(fd: int, mode: int, run_dir: str, path: str, wait_s: float) -> None:
    """``flock(fd, mode)``, retried while an earlier instance of this job holds it (up to ``wait_s``)."""
    start, announced = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError as err:
            if err.errno in NO_LOCKS:
                raise _unsupported(run_dir, path, err) from None
            raise
        holder, waited = read_holder(path), time.monotonic() - start
        limit = wait_s if _same_job(holder) else 0.0
        if waited >= max(limit, 0.0 if holder else NAME_GRACE_S):
            raise RunDirLockedError(_refusal(run_dir, path, holder, waited if limit > 0 else None))
        if limit > 0 and not announced:
            print(
                f"stabledrl: {run_dir} is locked by an earlier instance of this job ({describe_holder(holder)}); "
                f"waiting up to {wait_s:.0f} s (logging.lock_wait_s) for it to end",
                file=sys.stderr,
                flush=True,
            )
            announced = True
        time.sleep(POLL_S)


def _open_error(run_dir: str, path: str, err: OSError) -> UserError:
    return UserError(f"cannot create the run lock {path} ({err.strerror or err}); choose a writable logging.run_dir")


def acquire(run_dir: str, *, wait_s: float = 0.0) -> None:
    """Hold ``<run_dir>/.lock`` exclusively (re-entrant in this process; :func:`release` undoes one)."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.realpath(lock_path(run_dir))
        if path in _HELD:
            _HELD[path][1] += 1
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise _open_error(run_dir, lock_path(run_dir), err) from None
    try:
        _flock(fd, fcntl.LOCK_EX, run_dir, path, wait_s)
        data = (json.dumps(holder_record()) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)  # a reader on another node (NFS) sees the holder
    except BaseException:
        os.close(fd)  # closing drops the lock too, if it was taken
        raise
    _HELD[path] = [fd, 1]


def release(run_dir: str) -> None:
    """Undo one :func:`acquire`; the last one empties the file and drops the lock."""
    path = os.path.realpath(lock_path(run_dir))
    held = _HELD.get(path)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[path]
    try:
        os.ftruncate(held[0], 0)  # still ours: nobody else can hold it yet
        fcntl.flock(held[0], fcntl.LOCK_UN)  # also where a child forked outside Python keeps a copy
    except OSError:
        pass
    os.close(held[0])


def holds(run_dir: str) -> bool:
    return os.path.realpath(lock_path(run_dir)) in _HELD


@contextmanager
def holding(run_dir: str, *, wait_s: float = 0.0) -> Iterator[None]:
    """``with holding(run_dir):`` the exclusive lock inside the block."""
    acquire(run_dir, wait_s=wait_s)
    try:
        yield
    finally:
        release(run_dir)


def wait_until_unlocked(run_dir: str, *, wait_s: float = 0.0) -> None:
    """Refuse (after waiting for an earlier instance of this job, up to ``wait_s``) while another
    process holds ``<run_dir>/.lock``; takes nothing, creates nothing (the preflight's check)."""
    path = lock_path(run_dir)
    if holds(run_dir):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # never locked
    except OSError as err:
        raise _open_error(run_dir, path, err) from None
    try:
        _flock(fd, fcntl.LOCK_SH, run_dir, path, wait_s)  # shared: two checks never refuse each other
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def launch_rank() -> int:
    """This process's global rank: the process group's, else the launcher's environment."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else detect_launch_env().rank


@contextmanager
def run_dir_lock(cfg) -> Iterator[None]:
    """On rank 0, hold ``cfg.logging.run_dir``'s lock inside the block (``logging.lock_wait_s``,
    ``logging.run_lock``); other ranks take nothing."""
    lg = cfg.logging
    if not lg.run_lock or launch_rank() != 0:
        yield
        return
    with holding(lg.run_dir, wait_s=lg.lock_wait_s):
        yield


def check_run_dir_unlocked(cfg) -> None:
    """The preflight's :func:`wait_until_unlocked` for ``cfg`` (rank 0 only: another rank of the same
    job may see its own rank 0 holding it)."""
    lg = cfg.logging
    if lg.run_lock and launch_rank() == 0:
        wait_until_unlocked(lg.run_dir, wait_s=lg.lock_wait_s)


def _forget_in_child() -> None:
    for fd, _ in _HELD.values():
        try:
            os.close(fd)  # the parent's lock stays: it has its own descriptor of the open file
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
