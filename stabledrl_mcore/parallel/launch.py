"""Run a function on N local processes with torchrun-style environment variables.

Used by the tests and by single-node runs (``stabledrl train --nproc N``);
clusters launch with ``torchrun`` or ``srun`` instead. Every child is started
with the ``spawn`` method, gets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT``, and is stopped by PID if any rank fails or the
deadline passes, so a failing rank never leaves the others hanging.

Signals and lifetime: SIGTERM/SIGUSR1 sent to the launcher are forwarded to every
rank; each rank gets ``PR_SET_PDEATHSIG`` (Linux), so SIGKILL of the launcher
takes its ranks with it. Ctrl-C (SIGINT, which a terminal sends to the launcher and its ranks
alike) belongs to the launcher: the ranks ignore it, and the launcher stops them by PID and
raises :class:`Interrupted` (no rank prints a traceback). A rank's return value is its exit status (``fn`` may
return e.g. 75 after a pre-emption); :func:`spawn` returns them. A rank is done only when ``fn``
returned: ``sys.exit`` inside it, or a process that ends without returning (``os._exit(0)``
included), is a failure named by rank; the first failure named is the first rank to fail in
time, not one that failed because a peer died (gloo's ``Connection reset by peer``).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

import psutil
import torch

from stabledrl_mcore.parallel.bootstrap import AGENT_STORE_VARIABLE, destroy

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_HELD: List[int] = []  # forwarded signals a rank received before ``fn`` installed its own handlers


class WorkerFailed(RuntimeError):
    """A spawned rank raised, crashed, returned an unexpected status or timed out.

    ``str(err)`` and ``first_error`` are one line about the first failing rank
    (``rank 1: ValueError: ...``); ``details`` holds every failing rank's full
    traceback (for ``--debug``); ``first_type`` is the qualified name of the first
    exception's class (or None); ``exit_codes`` is each rank's exit status.
    """

    def __init__(
        self,
        first_error: str,
        details: str = "",
        *,
        first_type: Optional[str] = None,
        exit_codes: Sequence[Optional[int]] = (),
    ):
        super().__init__(first_error)
        self.first_error, self.details, self.first_type = first_error, details, first_type
        self.exit_codes = list(exit_codes)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) reached the launcher of :func:`spawn`: every rank has been stopped."""


def die_with_parent(parent_pid: int) -> bool:
    """Linux: SIGKILL this process as soon as ``parent_pid`` (its parent) dies.

    If the parent already died before the request took effect, exit at once.
    Returns False where the platform has no parent-death signal.
    """
    if not sys.platform.startswith("linux"):
        return False

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody would reap or stop us
        os._exit(1)
    return True


def bind_forked_children() -> None:
    """Every process the main thread forks from now on dies with this one (parent-death SIGKILL).

    For helpers such as Megatron's checkpoint write workers, which are forked and
    would otherwise outlive a SIGKILLed trainer. Forks from other threads are left
    alone (the signal follows the forking thread, which may end first). Idempotent.
    """
    if getattr(bind_forked_children, "done", False) or not hasattr(os, "register_at_fork"):
        return
    parent = {"pid": os.getpid(), "main": True}

    def before() -> None:
        parent.update(pid=os.getpid(), main=threading.current_thread() is threading.main_thread())

    def after_in_child() -> None:
        if parent["main"]:
            die_with_parent(parent["pid"])

    os.register_at_fork(before=before, after_in_child=after_in_child)
    bind_forked_children.done = True


def take_held_signals() -> List[int]:
    """Forwarded signals this rank received before its own handlers were installed (then cleared)."""
    held = list(_HELD)
    _HELD.clear()
    return held


def error_line(err: BaseException, rank: Optional[int] = None, limit: int = 500) -> str:
    """``[rank 1: ]ValueError: message`` on one line (the format of :class:`WorkerFailed`; a CLI
    under torchrun/srun can print a rank's own error the same way)."""
    line = " ".join(f"{type(err).__name__}: {err}".split())
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return line if rank is None else f"rank {rank}: {line}"


def _write_json(path: str, data: Dict[str, Any]) -> None:
    with open(path + ".part", "w") as handle:
        json.dump(data, handle)
    os.replace(path + ".part", path)


def _entry(payload: bytes, rank, world_size, port, threads, report_dir, parent_pid, hold):
    """A rank: parent-death signal and signal holding first, then unpickle and run ``fn``.

    Only a return from ``fn`` completes the rank: then ``rank<N>.done.json`` (its status, the
    time) is written. An exception, ``SystemExit`` included (``sys.exit`` in user code), writes
    ``rank<N>.error.json``; a rank that leaves neither (``os._exit``, a signal) failed too."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's (it stops the ranks)
    if hold:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, lambda signum, frame: _HELD.append(signum))
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{AGENT_STORE_VARIABLE: "True"},  # as under torchrun: this launcher serves the store
    )
    report = os.path.join(report_dir, f"rank{rank}")
    done: Optional[int] = None
    try:
        fn, args = pickle.loads(payload)
        if threads:
            torch.set_num_threads(threads)
        done = _status(fn(*args))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, SystemExit included
        line = (
            f"SystemExit: sys.exit({err.code!r}) was called before the rank's function returned "
            f"(sys.exit in user code?); a rank is done only when its function returns"
            if isinstance(err, SystemExit)
            else error_line(err)
        )
        _write_json(
            report + ".error.json",
            {
                "time": time.time(),
                "type": f"{type(err).__module__}.{type(err).__qualname__}",
                "line": line,
                "traceback": traceback.format_exc()[-20000:],
            },
        )
    finally:
        if torch.distributed.is_initialized():  # only ranks that started a process group
            try:
                destroy(collect=False)  # the process ends here
            except Exception:  # pragma: no cover - best effort clean-up
                pass
    if done is None:
        raise SystemExit(1)
    _write_json(report + ".done.json", {"code": done, "time": time.time()})
    raise SystemExit(done)


def hosted_store() -> "torch.distributed.TCPStore":
    """The ranks' rendezvous store, served by this process on a port the kernel picks at bind
    time (a port found free and bound later can be taken in between: EADDRINUSE under load)."""
    return torch.distributed.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(minutes=30), wait_for_workers=False
    )


def _status(value: Any) -> int:
    """``fn``'s return value as an exit status: an int is one, anything else is 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (e.g. checkpoint-writer helpers), by PID."""
    try:
        pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        pids = [pid]
    for target in pids:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _read_reports(report_dir: str, world_size: int, kind: str) -> Dict[int, Dict[str, Any]]:
    found = {}
    for rank in range(world_size):
        path = os.path.join(report_dir, f"rank{rank}.{kind}.json")
        try:
            with open(path) as handle:
                found[rank] = json.load(handle)
        except (OSError, ValueError):
            pass
    return found


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


PEER_DEATH = re.compile(
    r"connection (reset|closed|refused)|broken pipe|remote process exited|peer.*(closed|died|exited)"
    r"|failed to recv|socket closed|communicator was aborted",
    re.IGNORECASE,
)
"""Errors a rank raises because another rank died (gloo's ``Connection reset by peer``, NCCL's
``remote process exited``): such a rank is never named as the first failure while another is."""


def _finished(rank: int, code: Optional[int], done: Dict[int, Dict[str, Any]], expected: Sequence[int]) -> bool:
    """Rank ``rank`` ended as it should: its function returned 0 or an expected status, and the
    process exited with it."""
    returned = done.get(rank, {}).get("code")
    return code is not None and returned == code and (code == 0 or code in expected)


def _failure(
    procs,
    report_dir: str,
    expected: Sequence[int],
    reason: Optional[str],
    stopped_by_launcher: Sequence[int],
    received: Sequence[int],
    died: Dict[int, float],
) -> Optional[WorkerFailed]:
    """The error to raise (None when every rank returned 0 or an expected status). The first
    failure is the earliest (by the time of its error report, or of its death as the launcher saw
    it), a rank that failed of a peer's death (:data:`PEER_DEATH`) only when no other failed."""
    world = len(procs)
    codes = [p.exitcode for p in procs]
    errors = _read_reports(report_dir, world, "error")
    done = _read_reports(report_dir, world, "done")
    bad = [
        r
        for r, c in enumerate(codes)
        if r not in errors and r not in stopped_by_launcher and not _finished(r, c, done, expected)
    ]
    if not errors and not bad and not reason:
        return None
    first_type, sent = (
        None,
        "".join(
            f" after {signal.Signals(s).name} was forwarded to the ranks"
            for s in sorted(set(received) & set(FORWARDED_SIGNALS))
        ),
    )
    failures = [(bool(PEER_DEATH.search(errors[r]["line"])), errors[r]["time"], r) for r in errors]
    failures += [(False, done.get(r, {}).get("time", died.get(r, float("inf"))), r) for r in bad]
    rank = min(failures)[2] if failures else None
    if rank in errors:
        first, first_type = f"rank {rank}: {errors[rank]['line']}", errors[rank]["type"]
    elif rank is not None:
        first = f"rank {rank} {_how_it_ended(codes[rank], done.get(rank))}{sent}"
    else:
        first = f"{reason}{sent}"
    lines = [f"{first} (exit codes {codes})"]
    for r in range(world):
        if r in errors:
            lines.append(f"--- rank {r} ---\n{errors[r]['traceback']}")
        elif r in stopped_by_launcher:
            lines.append(
                f"--- rank {r}: stopped by the launcher"
                + (f" after rank {rank} failed" if rank is not None else f" ({reason})")
                + " ---"
            )
        elif r in bad:
            lines.append(f"--- rank {r}: {_how_it_ended(codes[r], done.get(r))} ---")
    return WorkerFailed(first, "\n".join(lines), first_type=first_type, exit_codes=codes)


def _how_it_ended(code: Optional[int], done: Optional[Dict[str, Any]]) -> str:
    if done is not None and done.get("code") == code:
        return f"returned status {code}"
    if code == 0:
        return "exited with status 0 before finishing (sys.exit or os._exit in user code?)"
    return _describe_exit(code)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 600.0,
    threads: Optional[int] = 1,
    grace: float = 5.0,
    expected_codes: Sequence[int] = (),
    hold_signals: bool = False,
) -> List[int]:
    """Run ``fn(*args)`` on ``world_size`` processes; return each rank's exit status.

    ``fn`` must be picklable (module level). ``threads`` sets torch's intra-op
    threads per rank (1 is fastest for tiny models on a small CPU). A rank's exit
    status is ``fn``'s return value when that is an int, else 0; any status other
    than 0 and ``expected_codes`` is a failure. When one rank fails, the others get
    ``grace`` seconds to finish before they are killed, and :class:`WorkerFailed`
    names the first failing rank. SIGTERM/SIGUSR1 received meanwhile are forwarded
    to the ranks; with ``hold_signals`` a rank keeps them (see
    :func:`take_held_signals`) until ``fn`` installs its own handlers, instead of
    dying of one during start-up. The ranks ignore SIGINT; a SIGINT to this process
    (called from the main thread) stops them and raises :class:`Interrupted`.
    """
    ctx = mp.get_context("spawn")
    report_dir = tempfile.mkdtemp(prefix="stabledrl-spawn-")
    store = hosted_store()  # bound before any rank starts: no other process can take its port
    port, payload = store.port, pickle.dumps((fn, tuple(args)))
    procs = [
        ctx.Process(
            target=_entry,
            daemon=False,
            args=(payload, r, world_size, port, threads, report_dir, os.getpid(), hold_signals),
        )
        for r in range(world_size)
    ]
    received: List[int] = []
    previous = _forward_signals(procs, received)
    deadline, reason, stopped = time.monotonic() + timeout, None, []
    died: Dict[int, float] = {}  # rank -> when the launcher saw it end (time.time(), as the reports)
    try:
        _start(procs)
        for sig in sorted(set(received) & set(FORWARDED_SIGNALS)):  # arrived while the ranks were being started
            _send(procs, sig)
        while any(p.is_alive() for p in procs):
            if signal.SIGINT in received:
                reason = "interrupted"
                break
            _wait_for_deaths(procs, died, 0.05)
            if _read_reports(report_dir, world_size, "error") or _unexpected_exit(procs, report_dir, expected_codes):
                reason = "a rank failed"
                break
            if time.monotonic() > deadline:
                reason = f"timed out after {timeout:.0f} s"
                break
    finally:
        if reason == "a rank failed":  # let the other ranks report their own errors first
            grace_end = time.monotonic() + grace
            while any(p.is_alive() for p in procs) and time.monotonic() < grace_end:
                _wait_for_deaths(procs, died, 0.05)
        for rank, proc in enumerate(procs):
            if proc.pid is not None and proc.is_alive():
                stopped.append(rank)
                _kill_tree(proc.pid)
            if proc.pid is not None:
                proc.join()
        _restore_signals(previous)
        if sys.exc_info()[0] is not None:  # e.g. Ctrl-C in the launcher: the ranks are gone, so is this
            shutil.rmtree(report_dir, ignore_errors=True)
    if reason == "interrupted":
        shutil.rmtree(report_dir, ignore_errors=True)
        raise Interrupted()
    try:
        error = _failure(
            procs, report_dir, expected_codes, None if reason == "a rank failed" else reason, stopped, received, died
        )
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    if error is not None:
        raise error
    return [p.exitcode for p in procs]


def _start(procs) -> None:
    """Start the ranks with SIGINT ignored from their first instruction (an exec keeps an ignored
    signal), so a Ctrl-C while a rank imports is no traceback either."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        for proc in procs:
            proc.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, handler if handler is not None else signal.SIG_DFL)


def _unexpected_exit(procs, report_dir: str, expected: Sequence[int]) -> bool:
    """A rank ended without finishing: its function did not return (``os._exit(0)`` included), or
    returned a status that is neither 0 nor expected."""
    done = None
    for rank, proc in enumerate(procs):
        if proc.exitcode is None:
            continue
        done = done if done is not None else _read_reports(report_dir, len(procs), "done")
        if not _finished(rank, proc.exitcode, done, expected):
            return True
    return False


def _wait_for_deaths(procs, died: Dict[int, float], timeout: float) -> None:
    """Wait up to ``timeout`` s for a rank to end (woken at once when one does); note when each did."""
    alive = [p.sentinel for r, p in enumerate(procs) if r not in died and p.pid is not None]
    if alive:
        mp_connection.wait(alive, timeout)
    else:
        time.sleep(timeout)
    now = time.time()
    for rank, proc in enumerate(procs):
        if rank not in died and proc.pid is not None and proc.exitcode is not None:
            died[rank] = now


def _forward_signals(procs, received: List[int]):
    """Install SIGTERM/SIGUSR1 handlers that pass the signal on to every live rank, and a SIGINT
    handler that only notes it (:func:`spawn` then stops the ranks)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def forward(signum, frame):
        received.append(signum)
        _send(procs, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored (a background job): left so
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    return previous


def _send(procs, signum: int) -> None:
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass


def _restore_signals(previous) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def exit_status(codes: Sequence[int]) -> int:
    """One status for a launcher: the largest of its ranks' statuses (0 when all are 0)."""
    return max(codes, default=0)
