"""A user's number-valued function called in a child process that is killed when a call runs out of time.

:class:`IsolatedFunction` runs ``fn`` in one persistent worker process (per process that calls it,
started at the first call): each call sends its arguments down a pipe and waits for the answer
under a ``poll`` deadline, so no signal and no thread is needed, and whatever ``fn`` does (catch
``BaseException`` and go on, block in C code, ``sys.exit``, ``os._exit``, crash the interpreter)
the caller gets its time back: a call past its limit kills the worker and everything it started
(``SIGKILL``) and the next call starts a fresh one. The worker runs in a session of its own and is
the subreaper of everything below it (:mod:`~stabledrl_mcore.common.process_tree`), so a process
``fn`` starts goes with it even if it called ``setsid()`` or its parent exited; so it does when the
worker ends by itself (its pipe closed, its parent gone). The worker never takes the job's signals (``SIGINT``, ``SIGTERM``, ``SIGUSR1``
are ignored there: the caller alone decides on pre-emption and Ctrl-C) and it exits when its pipe
closes or its parent process is gone (checked every half second).

``fn`` travels by pickle, i.e. by reference for a module-level function: the worker imports its
module from ``sys.path`` (the caller's, sent along), or from the file given in ``source_files`` for
a module that was loaded from a file under its own name. Its value comes back converted by
:func:`finite_float` in the worker, inside the time limit (a value's ``__float__`` is user code too).

Cost: a round trip of two small pickles per call, and one start per worker (an interpreter, this
package's ``common`` layer and ``fn``'s module) at the first call and after each timeout or crash.
A worker that cannot start (``fn``'s module no longer imports, or the start takes longer than
``start_timeout_s``) is not tried again: every later call fails at once with the same message.

This module imports the standard library and :mod:`stabledrl_mcore.common` (``errors``,
``process_tree``) only, so the worker starts without torch.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from stabledrl_mcore.common.errors import one_line
from stabledrl_mcore.common.process_tree import become_subreaper, kill_descendants, kill_session, kill_tree, running

START_TIMEOUT_S = 120.0
"""Seconds a worker may take to start (the interpreter and ``fn``'s imports); not part of any call's limit."""
_HEADER = struct.Struct(">Q")
_PARENT_CHECK_S = 0.5
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from stabledrl_mcore.common.isolated_calls import serve; serve()"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class NotANumber(ValueError):
    """A function's value that is not a finite number (the message says what it was)."""


class CallFailed(Exception):
    """A call that raised (``kind`` "error"), returned a non-number ("value"), ran out of time
    ("timeout"), lost its worker process ("crash") or found none that could start ("start")."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (an int too long to print, a failing repr: its type)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int past Python's digit limit, or a user __repr__
        size = f" of {value.bit_length()} bits" if isinstance(value, int) else ""
        text = f"<{type(value).__name__}{size}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def finite_float(value: Any) -> float:
    """``value`` as a finite float (``bool`` is 0/1); :class:`NotANumber` for a string, a value
    ``float()`` refuses or overflows on (``10**400``), NaN or inf. Whatever a value's own
    ``__float__`` raises otherwise propagates."""
    if isinstance(value, (str, bytes, bytearray)):
        raise NotANumber(f"returned {short_repr(value)}, not a finite number")
    try:
        number = float(value)
    except OverflowError:
        raise NotANumber(f"returned {short_repr(value)}, too large for a float, not a finite number") from None
    except (TypeError, ValueError):
        raise NotANumber(f"returned {short_repr(value)}, not a finite number") from None
    if not math.isfinite(number):
        raise NotANumber(f"returned {short_repr(value)}, not a finite number")
    return number


def raised(err: BaseException) -> str:
    """``"raised TYPE: message"`` on one line, the message cut to 300 characters."""
    return f"raised {type(err).__name__}: {one_line(err)[:300]}"


def _send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int, deadline: Optional[float]) -> Optional[bytes]:
    """``size`` bytes from ``fd``; None at end of file; :class:`TimeoutError` past ``deadline``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    chunks, have = [], 0
    while have < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                if time.monotonic() >= deadline:
                    raise TimeoutError
                continue
        chunk = os.read(fd, size - have)
        if not chunk:
            return None
        chunks.append(chunk)
        have += len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: Optional[float]) -> Any:
    """The next message on ``fd`` (None at end of file); :class:`TimeoutError` past ``deadline``."""
    header = _read_exactly(fd, _HEADER.size, deadline)
    if header is None:
        return None
    body = _read_exactly(fd, _HEADER.unpack(header)[0], deadline)
    return None if body is None else pickle.loads(body)


def _stop(proc: Optional[subprocess.Popen]) -> None:
    """Kill ``proc`` and every process below it (its session, and what left it) and reap it."""
    if proc is None:
        return
    if proc.poll() is None:
        kill_tree(proc.pid)
    else:  # reaped: its pid may be another process's by now, but not while its session lives
        kill_session(proc.pid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a kernel that does not reap
        pass
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _alive(proc: subprocess.Popen) -> bool:
    """``proc`` has not ended. A killed worker whose main thread is already a zombie is not
    reported by ``waitpid`` until its other threads have exited too (Linux delays a thread-group
    leader's wait); it is ending, so it is waited for here rather than sent the next call."""
    if proc.poll() is not None:
        return False
    if running(proc.pid):
        return True
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a kernel that does not reap
        pass
    return False


def _stop_all(holder: Dict[str, Any]) -> None:
    if holder.get("owner") == os.getpid():
        _stop(holder.get("proc"))
    holder["proc"] = None


class IsolatedFunction:
    """``fn`` called in a worker process (module docstring): :meth:`call` returns ``finite_float(fn(*args))``
    or raises :class:`CallFailed`. A ``KeyboardInterrupt`` while waiting stops the worker and propagates,
    as does one that ``fn`` raises itself."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        source_files: Optional[Dict[str, str]] = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        try:
            payload = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - pickle raises PicklingError, AttributeError, TypeError
            raise TypeError(f"{short_repr(fn)} cannot be sent to a worker process ({one_line(err)})") from None
        self._setup(payload, dict(source_files or {}), float(start_timeout_s))

    def _setup(self, payload: bytes, source_files: Dict[str, str], start_timeout_s: float) -> None:
        self._payload, self._files, self._start_timeout_s = payload, source_files, start_timeout_s
        self._holder: Dict[str, Any] = {"proc": None, "owner": None}
        self._broken: Optional[str] = None
        self._lock = threading.Lock()
        self.starts = 0
        """Workers started so far in this process (the first, then one per timeout or crash)."""
        weakref.finalize(self, _stop_all, self._holder)

    def __getstate__(self) -> Dict[str, Any]:  # a copy starts its own worker
        return {"payload": self._payload, "files": self._files, "start_timeout_s": self._start_timeout_s}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._setup(state["payload"], state["files"], state["start_timeout_s"])

    @property
    def worker_pid(self) -> Optional[int]:
        """The running worker's process id (None before the first call and after a kill)."""
        proc = self._holder["proc"] if self._holder["owner"] == os.getpid() else None
        return None if proc is None or proc.poll() is not None else proc.pid

    def call(self, args: Tuple[Any, ...], timeout_s: float) -> float:
        with self._lock:
            proc = self._running()
            try:
                _send(proc.stdin.fileno(), tuple(args))
            except BrokenPipeError:
                self._lost(proc, "before the call")
            except Exception as err:  # noqa: BLE001 - an argument pickle cannot carry
                message = f"its arguments cannot be sent to the worker process ({one_line(err)})"
                raise CallFailed("error", message) from None
            try:
                reply = _receive(proc.stdout.fileno(), time.monotonic() + timeout_s)
            except TimeoutError:
                self.close()
                raise CallFailed("timeout", "its worker process was killed; the next call starts a fresh one") from None
            except BaseException:  # Ctrl-C while waiting: the worker's state is unknown
                self.close()
                raise
            if reply is None:
                self._lost(proc, "during the call")
            kind, value = reply
            if kind == "ok":
                return value
            if kind == "interrupt":
                raise KeyboardInterrupt(value)
            raise CallFailed(kind, value)

    def close(self) -> None:
        """Kill the worker, if any (the next call starts another)."""
        _stop_all(self._holder)

    def _lost(self, proc: subprocess.Popen, when: str) -> None:
        self.close()
        status = proc.returncode
        how = f"was killed by signal {-status}" if status is not None and status < 0 else f"exited ({status})"
        raise CallFailed("crash", f"its worker process {how} {when} (the next call starts a fresh one)")

    def _running(self) -> subprocess.Popen:
        holder = self._holder
        if holder["owner"] != os.getpid():  # a forked copy: the worker is the parent's
            holder.update(proc=None, owner=os.getpid())
        proc = holder["proc"]
        if proc is not None and _alive(proc):
            return proc
        self.close()
        if self._broken is not None:
            raise CallFailed("start", self._broken)
        proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, _ROOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        holder["proc"] = proc
        self.starts += 1
        handshake = {"path": list(sys.path), "files": self._files, "fn": self._payload, "parent": os.getpid()}
        try:
            _send(proc.stdin.fileno(), handshake)
            reply = _receive(proc.stdout.fileno(), time.monotonic() + self._start_timeout_s)
        except TimeoutError:
            reply = ("start", f"took longer than {self._start_timeout_s:g} s to start")
        except BrokenPipeError:
            reply = None
        except BaseException:
            self.close()
            raise
        if reply is None:
            proc.wait()
            reply = ("start", f"exited ({proc.returncode}) while starting")
        if reply[0] != "ready":
            self.close()
            self._broken = f"its worker process could not start: {reply[1]}"
            raise CallFailed("start", self._broken)
        return proc


def _load_source_files(files: Dict[str, str]) -> None:
    for name, path in files.items():
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(_PARENT_CHECK_S)
        if os.getppid() != parent:
            kill_descendants(os.getpid())
            os._exit(0)


def _answer(fn: Callable[..., Any], args: Tuple[Any, ...]) -> Tuple[str, Any]:
    try:
        value = fn(*args)
    except KeyboardInterrupt as err:  # raised by the function itself (the worker ignores SIGINT)
        return "interrupt", one_line(err)
    except BaseException as err:  # noqa: BLE001 - the user's code, SystemExit included: reported
        return "error", raised(err)
    try:
        return "ok", finite_float(value)
    except NotANumber as err:
        return "value", str(err)
    except BaseException as err:  # noqa: BLE001 - the value's own __float__ / __repr__
        return "error", raised(err)


def serve() -> None:
    """The worker's loop (run by :class:`IsolatedFunction` as ``python -c``): handshake, then one
    answer per call until the pipe closes; then nothing it started is left."""
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    become_subreaper()
    try:
        _serve()
    finally:
        kill_descendants(os.getpid())


def _serve() -> None:
    requests, replies = os.dup(0), os.dup(1)
    quiet = os.open(os.devnull, os.O_RDONLY)
    os.dup2(quiet, 0)  # the function's input() reads nothing, its prints go to stderr
    os.dup2(2, 1)
    os.close(quiet)
    handshake = _receive(requests, None)
    if handshake is None:
        return
    sys.path[:] = handshake["path"]
    try:
        _load_source_files(handshake["files"])
        fn = pickle.loads(handshake["fn"])
    except BaseException as err:  # noqa: BLE001 - reported to the caller as one line
        _send(replies, ("start", f"loading the function {raised(err)}"))
        return
    threading.Thread(target=_exit_with_parent, args=(handshake["parent"],), daemon=True).start()
    _send(replies, ("ready", os.getpid()))
    while True:
        args = _receive(requests, None)
        if args is None:
            return
        _send(replies, _answer(fn, args))
