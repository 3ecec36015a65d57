"""Run a function on N local processes with torchrun-style environment variables.

Used by the tests and by single-node CPU runs (``stabledrl train --nproc N``);
clusters launch with ``torchrun`` or ``srun`` instead. Every child is started
with the ``spawn`` method, gets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT``, and is stopped by PID if any rank fails or the
deadline passes, so a failing rank never leaves the others hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence


class WorkerFailed(RuntimeError):
    """A spawned rank raised, crashed or timed out."""


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (e.g. checkpoint-writer helpers), by PID."""
    try:
        import psutil

        pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        pids = [pid]
    for target in pids:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _entry(fn, rank, world_size, port, threads, args, error_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if threads:
        import torch

        torch.set_num_threads(threads)
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as handle:
            handle.write(traceback.format_exc()[-20000:])
        raise SystemExit(1)
    finally:
        try:
            from .bootstrap import destroy

            destroy()
        except Exception:  # pragma: no cover - best effort clean-up
            pass


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
          timeout: float = 600.0, threads: Optional[int] = 1, grace: float = 5.0) -> None:
    """Run ``fn(*args)`` on ``world_size`` processes; raise :class:`WorkerFailed` on any failure.

    ``fn`` must be importable (module level). ``threads`` sets torch's intra-op
    threads per rank (1 is fastest for tiny models on a small CPU). When one rank
    fails, the others get ``grace`` seconds to finish before they are killed.
    """
    ctx = mp.get_context("spawn")
    error_dir = tempfile.mkdtemp(prefix="stabledrl-spawn-")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, threads, tuple(args), error_dir),
                         daemon=False) for r in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while any(p.is_alive() for p in procs):
            if os.listdir(error_dir) or any(p.exitcode not in (None, 0) for p in procs):
                failure = "a rank failed"
                break
            if time.monotonic() > deadline:
                failure = f"timed out after {timeout:.0f} s"
                break
            time.sleep(0.05)
    finally:
        if failure == "a rank failed":  # let the other ranks report their own errors first
            grace_end = time.monotonic() + grace
            while any(p.is_alive() for p in procs) and time.monotonic() < grace_end:
                time.sleep(0.05)
        for proc in procs:
            if proc.is_alive():
                _kill_tree(proc.pid)
            proc.join()
    reports = []
    for name in sorted(os.listdir(error_dir)):
        with open(os.path.join(error_dir, name)) as handle:
            reports.append(f"--- {name[:-4]} ---\n{handle.read()}")
    shutil.rmtree(error_dir, ignore_errors=True)
    codes = [p.exitcode for p in procs]
    if failure or reports or any(c != 0 for c in codes):
        raise WorkerFailed(f"{failure or 'a rank failed'} (exit codes {codes})\n" + "\n".join(reports))
