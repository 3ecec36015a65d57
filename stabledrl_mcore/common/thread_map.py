"""``[call(slot, i) for i in range(count)]`` run by a few threads at once, results in index order.

:func:`map_in_threads` hands the indices out in order to ``workers`` threads; thread ``slot``
(``0 .. workers - 1``) keeps its slot for every call it makes, so a caller can give each slot a
resource of its own (a worker process: :class:`~stabledrl_mcore.common.isolated_calls.IsolatedFunction`
serves one call at a time). The calls are meant to wait (on a pipe, a sleep, I/O): that is when
threads overlap; pure Python work still shares the interpreter's lock.

Standard library only.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, List, Optional

_WAIT_S = 0.5
"""How often the calling thread wakes while it waits (a Ctrl-C is taken between waits at the latest)."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return max(os.cpu_count() or 1, 1)


def map_in_threads(
    call: Callable[[int, int], Any],
    count: int,
    workers: int,
    *,
    on_interrupt: Optional[Callable[[], None]] = None,
) -> List[Any]:
    """``[call(slot, i) for i in range(count)]`` with at most ``workers`` calls running at once.

    ``workers <= 1`` (or ``count <= 1``) calls in this thread, in order. Otherwise the threads are
    daemons started for this map only. An exception a call raises (any ``BaseException``) stops
    the handing out of further indices; once every thread has returned, the one of the lowest
    index is raised here. A ``KeyboardInterrupt`` in this thread while it waits stops the handing
    out, runs ``on_interrupt`` (which should make the running calls return, e.g. kill their
    worker processes) and propagates at once; the threads end on their own."""
    if workers <= 1 or count <= 1:
        return [call(0, i) for i in range(count)]
    results: List[Any] = [None] * count
    errors: dict = {}
    state = {"next": 0, "stop": False}
    lock = threading.Lock()
    done = threading.Event()
    running = [min(workers, count)]

    def work(slot: int) -> None:
        try:
            while True:
                with lock:
                    if state["stop"] or state["next"] >= count:
                        return
                    index = state["next"]
                    state["next"] += 1
                try:
                    results[index] = call(slot, index)
                except BaseException as err:  # noqa: BLE001 - re-raised in the calling thread
                    with lock:
                        errors[index] = err
                        state["stop"] = True
                    return
        finally:
            with lock:
                running[0] -= 1
                if not running[0]:
                    done.set()

    threads = [
        threading.Thread(target=work, args=(slot,), daemon=True, name=f"map_in_threads-{slot}")
        for slot in range(running[0])
    ]
    for thread in threads:
        thread.start()
    try:
        while not done.wait(_WAIT_S):
            pass
    except BaseException:  # Ctrl-C while waiting: stop handing out, free the running calls
        with lock:
            state["stop"] = True
        if on_interrupt is not None:
            on_interrupt()
        raise
    if errors:
        raise errors[min(errors)]
    return results
