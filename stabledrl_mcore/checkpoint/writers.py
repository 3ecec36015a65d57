"""Megatron's checkpoint writer with helpers that neither outlive their trainer nor hang it.

``dist_checkpointing``'s ``torch_dist`` save (``FileSystemWriterAsync``) writes each file in
a forked worker and waits for them with ``JoinableQueue.join()``. Three ways that goes wrong:

- the results travel through a ``multiprocessing.Manager`` queue: a spawned server process
  (~250 MB, it re-imports the launching module) that a SIGKILLed trainer leaves running;
- a worker that dies before it reports (its first line reads the process memory through
  ``psutil``, so a missing ``psutil`` kills every worker; so does the OOM killer) leaves the
  parent in ``join()`` for ever: the run hangs with no message;
- a SIGKILL of the parent would leave the workers writing.

:func:`bind_checkpoint_writers` keeps the results in an in-process queue, makes every forked
worker die with its parent, refuses to start without ``psutil`` (one line naming it), and
replaces the wait by :func:`write_buckets`, which watches each worker and turns one that fails
or dies into a :class:`CheckpointError` naming it and its file, on every rank (Megatron's own
finalisation broadcasts the failure; :func:`save_sharded` then gives every rank the failing
rank's words). Every save in :mod:`stabledrl_mcore.checkpoint` calls it.

A write that neither fails nor ends (a stalled file system) has a time limit,
``checkpoint.write_timeout_s`` (auto: :func:`write_limit_s`, 600 s plus 1 s per 10 MiB the rank
writes): past it the workers are killed and it is a :class:`CheckpointError` naming the file and
the worker that had not finished. A SIGTERM (a job being ended: SLURM kills 30 s later by default)
that arrives during a write gives it :data:`TERM_GRACE_S` more, then the same error: the run exits
within seconds instead of being killed mid-wait (the pre-emption handler registers the probe,
:func:`watch_termination`; a write that ends in time lets the trainer take the pre-emption path). A
write that starts after the signal (the pre-emption checkpoint itself) keeps its whole limit.

A worker is forked from a rank whose other threads (gloo's, OpenMP's, inductor's, wandb's, a
logger's) may hold locks at that instant; the fork copies them held, with no thread left to
release them. ``multiprocessing``'s fork flushes ``sys.stdout``/``sys.stderr`` in the parent before
the fork and in the worker when it ends: a worker forked while another thread was inside a print
waited for ever on the stream's lock, and its parent with it (issue 74;
``tools/fork_stall_repro.py``). The workers here take no lock they inherit
(:class:`_WriteWorker`, :func:`_write_one`): no flush, no feeder thread, no garbage collection,
no imports, no exit handlers; each reports through a pipe of its own.
"""

from __future__ import annotations

import gc
import io
import logging
import multiprocessing as mp
import os
import queue
import select
import signal
import sys
import time
from multiprocessing import popen_fork
from multiprocessing import util as mp_util
from multiprocessing.connection import wait
from multiprocessing.context import ForkProcess
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from stabledrl_mcore.checkpoint.integrity import CheckpointError
from stabledrl_mcore.parallel.launch import bind_forked_children

POLL_SECONDS = 0.2
"""How often the parent looks at its write workers while none has reported."""
TERM_GRACE_S = 10.0
"""How long a write still running when SIGTERM arrives may go on before it is stopped."""
FORK_START_S = 30.0
"""Seconds a forked write worker has to run its first line. Python 3.11's child side of ``fork``
(``PyOS_AfterFork_Child``) takes the runtime's thread-list lock before re-initialising it: forked
while another thread held it (a thread starting or ending), the child waits on it for ever inside
``os.fork()`` (seen in the test suite: a rank's worker in ``_PyThreadState_DeleteExcept``). Such a
worker is killed and forked again (:data:`FORK_TRIES` in all)."""

FORK_TRIES = 3

AUTO_LIMIT_BASE_S = 600.0
AUTO_LIMIT_BYTES_PER_S = 10 * 2**20
"""The automatic write time limit: ``AUTO_LIMIT_BASE_S`` plus the rank's bytes at this rate."""
JOIN_S = 5.0
"""How long a killed worker is waited for (one stuck in the kernel dies when its I/O returns)."""
_LAST_FAILURE: List[str] = []
"""This rank's last write failure (Megatron details a failure on its coordinator rank only)."""
_SAVE: Dict[str, Optional[float]] = {"timeout_s": None}
"""The time limit of the save in progress (:func:`save_sharded`); None = :func:`write_limit_s`'s."""
_TERMINATING: List[Callable[[], int]] = []
"""Probes that count the SIGTERMs received so far (:func:`watch_termination`)."""


def watch_termination(probe: Callable[[], int]) -> None:
    """From now on a write in progress when ``probe()`` (a count of SIGTERMs) grows is stopped
    :data:`TERM_GRACE_S` later (the pre-emption handler's count)."""
    if probe not in _TERMINATING:
        _TERMINATING.append(probe)


def _terminations() -> int:
    return sum(int(probe()) for probe in _TERMINATING)


def bucket_bytes(bucket: Any) -> int:
    """Bytes a write bucket ``(path, name, (byte items, tensor items))`` holds (best effort)."""
    total = 0
    try:
        byte_items, tensor_items = bucket[2]
    except (TypeError, ValueError, IndexError):
        return 0
    for _, data in list(byte_items) + list(tensor_items):
        if hasattr(data, "nbytes"):
            total += int(data.nbytes)
        elif hasattr(data, "getbuffer"):
            total += int(data.getbuffer().nbytes)
        elif isinstance(data, (bytes, bytearray)):
            total += len(data)
    return total


def write_limit_s(buckets: List[Any], timeout_s: Optional[float] = None) -> float:
    """``timeout_s`` (``checkpoint.write_timeout_s``), or the automatic limit: 600 s plus 1 s per
    10 MiB these buckets hold (a file system that slow is stalled)."""
    if timeout_s is not None:
        return float(timeout_s)
    return AUTO_LIMIT_BASE_S + sum(bucket_bytes(b) for b in buckets) / AUTO_LIMIT_BYTES_PER_S


def bind_checkpoint_writers() -> None:
    """Bind Megatron's checkpoint writer to this process (idempotent; before a save)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        raise CheckpointError("psutil is not installed: Megatron's checkpoint writer needs it (pip install psutil)")
    bind_forked_children()
    # None = no queue yet (Megatron would start a Manager for it); a queue already made is kept
    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()
    writer = filesystem_async.FileSystemWriterAsync
    if writer.__dict__.get("write_preloaded_data_multiproc") is not _BOUND:
        writer.write_preloaded_data_multiproc = _BOUND


class _NoCount:
    """Stands in for Megatron's per-worker count queue: :func:`write_buckets` counts by itself."""

    def get(self, *_: Any, **__: Any) -> None:
        return None

    def task_done(self) -> None:
        return None


class _Report:
    """Stands in for Megatron's results queue in a worker: keeps what the write puts on it."""

    def __init__(self) -> None:
        self.items: List[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)


_KEPT: List[Any] = []
"""A worker's inherited standard streams, kept alive: their finalizer would flush them (a lock)."""


def _lock_free_streams() -> None:
    """In a worker: ``sys.stdout``/``sys.stderr`` become unbuffered writers of their own (no lock)
    and ``sys.stdin`` None, since another thread of the parent may have held the inherited streams'
    locks at the fork; the inherited ones are kept (not finalized), and logging is off (its
    handlers write to them)."""
    _KEPT.append((sys.stdin, sys.stdout, sys.stderr))
    sys.stdin = None  # type: ignore[assignment]
    for name, fd in (("stdout", 1), ("stderr", 2)):
        try:
            stream = io.TextIOWrapper(
                io.FileIO(os.dup(fd), "w"), encoding="utf-8", errors="replace", write_through=True
            )
        except OSError:
            stream = None
        setattr(sys, name, stream)
    logging.disable(logging.CRITICAL)


def _write_one(transform_list: List[Any], use_msc: bool, index: int, bucket: Any, sender: Any) -> None:
    """A forked worker: write one bucket with Megatron's own ``write_preloaded_data``, send what it
    reported or whatever it raised through ``sender`` (a pipe), and exit at once.

    Nothing here waits on a lock that another thread of the parent may have held at the fork (see
    :class:`_WriteWorker` for what runs before): nothing is imported (the parent has every module),
    the garbage collector stays off (no inherited finalizer runs), the report is sent synchronously
    (no feeder thread), and ``os._exit`` skips the exit handlers and the flush of the inherited
    streams that ``multiprocessing`` would run."""
    code = 1
    try:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        report = _Report()
        try:
            kwargs = {"use_msc": True} if use_msc else {}
            FileSystemWriterAsync.write_preloaded_data(
                transform_list, index, bucket, report, _NoCount(), True, **kwargs
            )
            outcome = report.items[0] if report.items else (index, RuntimeError("the write reported nothing"))
        except BaseException as err:  # noqa: B036 - a worker reports anything, then ends
            outcome = (index, RuntimeError(f"{type(err).__name__}: {err}"))
        gc.disable()  # Megatron's write turns it back on
        try:
            sender.send(outcome)
        except Exception as err:  # noqa: BLE001 - an outcome that does not pickle: its words then
            sender.send((index, RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]} ({err})")))
        code = 1 if isinstance(outcome[1], BaseException) else 0
    finally:
        os._exit(code)


class _NoFlushPopen(popen_fork.Popen):
    """``multiprocessing``'s fork, without its flush of ``sys.stdout``/``sys.stderr`` first: that
    waits for any thread writing to them (one blocked on a full pipe: for ever)."""

    def __init__(self, process_obj: Any) -> None:  # noqa: D107 - popen_fork.Popen.__init__ less the flush
        self.returncode = None
        self.finalizer = None
        self._launch(process_obj)


class _WriteWorker(ForkProcess):
    """A forked write worker (:func:`_write_one`; ``multiprocessing.active_children`` lists it),
    forked without flushing the parent's streams (:class:`_NoFlushPopen`) and with the garbage
    collector off (:func:`_start_worker`). Right after the fork, before ``multiprocessing``'s own
    start-up, its standard streams are replaced (:func:`_lock_free_streams`: that start-up would
    close ``sys.stdin``) and the inherited ``multiprocessing`` after-fork hooks dropped (they
    reconnect managers, reset queues: objects the worker never uses)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:  # noqa: N802 - multiprocessing's name
        return _NoFlushPopen(process_obj)

    started_fd: Optional[int] = None
    """The write end of the pipe the worker says it runs on (:func:`_start_worker`)."""

    def _bootstrap(self, parent_sentinel: Any = None) -> int:
        if self.started_fd is not None:  # out of fork(): the parent stops waiting
            os.write(self.started_fd, b"s")
            os.close(self.started_fd)
        _lock_free_streams()
        mp_util._afterfork_registry.clear()
        return super()._bootstrap(parent_sentinel)


class _Inbox:
    """The workers' reports, one pipe each: ``get`` as ``queue.Queue.get`` (``queue.Empty`` when
    none came within ``timeout``)."""

    def __init__(self) -> None:
        self.readers: List[Any] = []
        self.opened: List[Any] = []

    def close(self) -> None:
        for reader in self.opened:
            reader.close()

    def get(self, timeout: float) -> Any:
        for reader in wait(self.readers, timeout):
            self.readers.remove(reader)
            try:
                return reader.recv()
            except Exception:  # noqa: BLE001 - ended without a (whole) report: found dead by its exit status
                continue
        raise queue.Empty


def _start_worker(args: tuple, inbox: _Inbox) -> Any:
    """Fork one write worker with ``args`` + its end of a new pipe, the garbage collector off in it;
    one that has not left ``fork()`` within :data:`FORK_START_S` is killed and forked again."""
    for _ in range(FORK_TRIES):
        reader, sender = mp.Pipe(duplex=False)
        started, started_w = os.pipe()
        worker = _WriteWorker(target=_write_one, args=(*args, sender), daemon=True)
        worker.started_fd = started_w
        enabled = gc.isenabled()
        gc.disable()
        try:
            worker.start()
        finally:
            if enabled:
                gc.enable()
            sender.close()  # the worker's alone: later workers do not inherit it
            os.close(started_w)
        try:  # readable: it ran its first line (or ended: then found dead by the watch)
            ready = select.select([started], [], [], FORK_START_S)[0]
        finally:
            os.close(started)
        if ready:
            inbox.readers.append(reader)
            inbox.opened.append(reader)
            return worker
        worker.kill()
        worker.join(FORK_START_S)
        reader.close()
    raise CheckpointError(
        f"a checkpoint write worker did not start: {FORK_TRIES} forks each waited {FORK_START_S:g} s "
        f"inside fork() (a lock another thread held when it forked); the save was not written"
    )


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def write_buckets(
    transform_list: List[Any], use_msc: bool, rank: int, buckets: List[Any], global_results_queue: Any
) -> None:
    """Megatron's ``write_preloaded_data_multiproc`` contract, watched: one forked worker per
    bucket (file); puts ``{index: [WriteResult]}`` on ``global_results_queue``, or a
    :class:`CheckpointError` as soon as one worker reports an error or is found dead without a
    report (the others are then killed). Never waits on a worker that cannot answer."""
    results = _Inbox()
    workers: List[Any] = []
    error = None
    try:
        for index, bucket in enumerate(buckets):
            workers.append(_start_worker((transform_list, use_msc, index, bucket), results))
    except CheckpointError as failed:  # one never left fork(): the ones started are killed below
        error = CheckpointError(f"rank {rank}, writing {os.path.basename(str(buckets[len(workers)][0]))}: {failed}")
    done: Dict[int, Any] = {}
    limit = write_limit_s(buckets, _SAVE["timeout_s"])
    deadline, term_deadline, terms = time.monotonic() + limit, None, _terminations()

    def where(index: int) -> str:
        return f"rank {rank}, writing {os.path.basename(str(buckets[index][0]))}"

    def stuck(why: str) -> CheckpointError:
        index = next(i for i in range(len(workers)) if i not in done)
        return CheckpointError(
            f"{why}: a checkpoint write worker (pid {workers[index].pid}, {where(index)}) had not finished; "
            f"it was killed and nothing was saved (a stalled file system?)"
        )

    while len(done) < len(workers) and error is None:
        try:
            index, outcome = results.get(timeout=POLL_SECONDS)
        except queue.Empty:
            dead = [i for i, w in enumerate(workers) if i not in done and w.exitcode is not None]
            if dead:
                try:  # one that reported just before it exited: its report is in the pipe
                    index, outcome = results.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    worker = workers[dead[0]]
                    error = CheckpointError(
                        f"a checkpoint write worker (pid {worker.pid}, {where(dead[0])}) died with "
                        f"{_exit_reason(worker.exitcode)} before reporting; nothing was saved"
                    )
                    break
            else:
                now = time.monotonic()
                if term_deadline is None and _terminations() > terms:  # a SIGTERM since the write began
                    term_deadline = now + TERM_GRACE_S
                if now >= deadline:
                    error = stuck(f"the checkpoint write timed out after {limit:.0f} s (checkpoint.write_timeout_s)")
                elif term_deadline is not None and now >= term_deadline:
                    error = stuck(f"SIGTERM arrived during a checkpoint write and {TERM_GRACE_S:g} s later")
                continue
        if index in done:
            continue
        if isinstance(outcome, BaseException):
            error = CheckpointError(f"a checkpoint write worker failed ({where(index)}): {outcome}")
        else:
            done[index] = outcome
    for worker in workers:
        if error is None:  # reported: it exits at once (written and synced; a stuck exit is killed)
            worker.join(max(deadline - time.monotonic(), JOIN_S))
        if worker.is_alive():
            worker.kill()
        worker.join(JOIN_S)
    results.close()
    _LAST_FAILURE[:] = [str(error)] if error is not None else []
    global_results_queue.put(error if error is not None else done)


_BOUND = staticmethod(write_buckets)


def save_sharded(sharded_state_dict: Dict[str, Any], directory: str, *, timeout_s: Optional[float] = None) -> None:
    """``dist_checkpointing.save`` through the bound writer (:func:`bind_checkpoint_writers`), a
    write failure on any rank raised on every rank as one :class:`CheckpointError` line naming the
    failing rank's worker and file. ``timeout_s``: the write time limit (None: :func:`write_limit_s`)."""
    from megatron.core import dist_checkpointing

    bind_checkpoint_writers()
    _LAST_FAILURE.clear()
    _SAVE["timeout_s"] = timeout_s
    try:
        dist_checkpointing.save(sharded_state_dict, directory)
    except CheckpointException as err:
        detail = _LAST_FAILURE[0] if _LAST_FAILURE else None
        detail = _first_failure(detail)  # collective: Megatron raised this on every rank
        if detail is None:
            failures = getattr(err, "failures", {}) or {}
            causes = [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
            first = next((c for c in causes if isinstance(c, BaseException)), None)
            detail = str(first) if first is not None else "another rank's write failed (its error is on rank 0)"
        detail = detail.removeprefix("Worker failure: ")  # Megatron's wrapper of the worker's error
        raise CheckpointError(f"writing checkpoint {directory} failed: {detail}") from None
    finally:
        _SAVE["timeout_s"] = None


def _first_failure(mine: Optional[str]) -> Optional[str]:
    """This rank's write failure, else the lowest rank's that had one (every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    found: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return mine if mine is not None else next((f for f in found if f is not None), None)
